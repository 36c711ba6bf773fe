"""Writes the word-level tokenizer of the tool-calling example into ``tokenizer/``.

Run once from the repository root (``python -m examples.agent_tools.make_tokenizer``); the
files are shipped, and everything else loads them with the transformers API
(``AutoTokenizer.from_pretrained("examples/agent_tools/tokenizer")``).

It follows Qwen2.5's conventions, so the endpoint renders chats with its ChatML template and
writes tool calls in Qwen's format (``<|im_start|>`` marks the family): ``<|im_end|>`` ends a
turn and is the EOS; ``<tool_call>`` and ``<tool_response>`` are tokens of their own. The
words are split on whitespace and numbers are tokens of their own, so a call the policy writes,
``<tool_call> {"name": "add", "arguments": {"x": 17 , "y": 25 }} </tool_call>`` (JSON, as the
endpoint parses it), is eleven tokens, the question's numbers among them; the words of the tools'
description are three tokens (``TOOLS_TEXT``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncrl.roles.agents.chat_format import QWEN_SYSTEM, QWEN_TOOLS, QWEN_TOOLS_END
from examples.agent_tools.calculator import ADD_TOOL, HIGH

_FAST: Any = PreTrainedTokenizerFast  # its constructor is untyped

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
"""Tokens of their own, not special: the policy writes them and the endpoint's text keeps them."""
TOOLS_TEXT = [QWEN_SYSTEM + QWEN_TOOLS, json.dumps(ADD_TOOL), QWEN_TOOLS_END]
"""The system message the endpoint writes when a request offers the ``add`` tool (Qwen's
default system prompt, its tools preamble, the tool as JSON, how to call one): constant texts,
a token each, so that the prompt stays 15 tokens long and the model small."""
NUMBERS = [str(n) for n in range(2 * HIGH + 1)]
WORDS = [
    "system",
    "user",
    "assistant",
    "+",
    "=",
    '{"name":',
    '"add",',
    '"arguments":',
    '{"x":',
    '"y":',
    ",",
    "}}",
    *NUMBERS,
]

TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's ChatML template, without its tool-calling branches (the endpoint writes the tools,
calls and results into the messages in Qwen's format before it renders them)."""


def build() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate([*SPECIAL, *TOOL_TOKENS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"\d+"), "isolated")]
    )
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens([*TOOL_TOKENS, *TOOLS_TEXT])
    return _FAST(  # type: ignore[no-any-return]
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        padding_side="left",
        chat_template=TEMPLATE,
    )


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer")
    build().save_pretrained(out)
    print(f"wrote {out}")
