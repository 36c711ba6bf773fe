"""Writes two small character-level tokenizers that follow the Qwen and Llama-3 conventions.

Run once from the repository root (``python -m examples.qwen.make_tokenizers``); the folders are
shipped, and everything else loads them with the transformers API
(``AutoTokenizer.from_pretrained("examples/qwen/tokenizer")``):

- ``tokenizer/``: Qwen2.5 and Qwen3. No BOS token; ``<|endoftext|>`` pads; ``<|im_end|>`` ends
  a turn and is the EOS (as in the instruct models, where generation stops on it); the ChatML
  template (``<|im_start|>role\\ncontent<|im_end|>\\n``, with Qwen2.5's default system turn).
- ``llama3_tokenizer/``: Llama-3. ``<|begin_of_text|>`` is prepended to every encoded text (the
  BOS); ``<|eot_id|>`` ends a turn and is the EOS of the instruct models; ``<|end_of_text|>`` ends
  a document; ``<|finetune_right_pad_id|>`` pads; turns are
  ``<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>``.

The vocabulary is one token per printable ASCII character and the newline, so that the chat
templates, the arithmetic task (``07+45=`` -> ``052``) and any English text encode without an
unknown token; the special tokens come after it, in each family's order, as in the real
vocabularies (where they follow about 150k or 128k merged tokens).

``python -m examples.qwen.make_tokenizers --check`` rebuilds both in memory and exits 1 if the
shipped files differ.
"""

from __future__ import annotations

import filecmp
import os
import sys
import tempfile
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

_FAST: Any = PreTrainedTokenizerFast  # its constructor is untyped

HERE = os.path.dirname(os.path.abspath(__file__))
CHARS = ["\n", *(chr(c) for c in range(0x20, 0x7F))]
"""The ordinary tokens: the newline and the 95 printable ASCII characters."""

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|finetune_right_pad_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's ChatML template, without its tool-calling branches."""

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
"""Llama-3 Instruct's template: the BOS once, then each turn under its header."""


def _characters(special: list[str]) -> Tokenizer:
    """A character-level tokenizer: ``CHARS`` first, then ``special`` as special tokens."""
    vocab = {token: i for i, token in enumerate([*CHARS, *special])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=special[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(special)
    return tok


def qwen() -> PreTrainedTokenizerFast:
    """The Qwen2.5 / Qwen3 conventions: no BOS, pad ``<|endoftext|>``, EOS ``<|im_end|>``."""
    return _FAST(  # type: ignore[no-any-return]
        tokenizer_object=_characters(QWEN_SPECIAL),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=QWEN_TEMPLATE,
    )


def llama3() -> PreTrainedTokenizerFast:
    """The Llama-3 conventions: BOS ``<|begin_of_text|>`` prepended, EOS ``<|eot_id|>``."""
    tok = _characters(LLAMA3_SPECIAL)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tok.token_to_id(bos))],
    )
    return _FAST(  # type: ignore[no-any-return]
        tokenizer_object=tok,
        bos_token=bos,
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
        padding_side="left",
        chat_template=LLAMA3_TEMPLATE,
    )


BUILDERS = {"tokenizer": qwen, "llama3_tokenizer": llama3}
"""Each shipped folder under ``examples/qwen/`` and the function that builds it."""


def write(root: str = HERE) -> list[str]:
    """Save every tokenizer of ``BUILDERS`` under ``root``; return the folders written."""
    out = []
    for folder, build in BUILDERS.items():
        path = os.path.join(root, folder)
        build().save_pretrained(path)
        out.append(path)
    return out


def differences(root: str = HERE) -> list[str]:
    """The shipped files (under ``root``) that differ from a fresh build, or are missing."""
    with tempfile.TemporaryDirectory() as fresh:
        write(fresh)
        wrong = []
        for folder in BUILDERS:
            for name in sorted(os.listdir(os.path.join(fresh, folder))):
                shipped = os.path.join(root, folder, name)
                built = os.path.join(fresh, folder, name)
                if not (os.path.exists(shipped) and filecmp.cmp(shipped, built, shallow=False)):
                    wrong.append(os.path.relpath(shipped, root))
        return wrong


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        bad = differences()
        for name in bad:
            print(
                f"{name}: differs from a fresh build; run python -m examples.qwen.make_tokenizers"
            )
        sys.exit(1 if bad else 0)
    for path in write():
        print(f"wrote {path}")
