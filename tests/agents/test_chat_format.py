"""Chat formats (asyncrl.roles.agents.chat_format): the tool formats of the Qwen and Llama-3
families, rendered through the tokenizers examples/qwen ships and parsed back."""

from __future__ import annotations

import os
from typing import Any

import pytest

from asyncrl.roles.agents.chat_format import PlainChat, TemplateChat, ToolCall, family_of
from tests.conftest import ROOT

transformers = pytest.importorskip("transformers")


def tokenizer(name: str) -> Any:
    return transformers.AutoTokenizer.from_pretrained(os.path.join(ROOT, "examples/qwen", name))


def call(arguments: str, call_id: str = "c1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "add", "arguments": arguments}}


def test_qwen_replies_parse_into_content_and_calls_and_a_malformed_call_stays_text() -> None:
    chat = TemplateChat(tokenizer("tokenizer"))
    assert chat.family == "qwen"
    text = (
        'let me add\n<tool_call>\n{"name": "add", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"x": 2}}\n</tool_call>'
    )
    assert chat.parse(text) == (
        "let me add",
        [ToolCall(name="add", arguments={"x": 1}), ToolCall(name="add", arguments={"x": 2})],
    )
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert chat.parse(broken) == (broken, [])
    assert chat.parse("<tool_call>\n[1, 2]\n</tool_call>")[1] == []
    assert chat.parse("= 5") == ("= 5", [])


def test_llama3_replies_are_one_json_call_or_text() -> None:
    chat = TemplateChat(tokenizer("llama3_tokenizer"))
    assert chat.family == "llama3"
    assert chat.parse('<|python_tag|>{"name": "add", "parameters": {"x": 1}}') == (
        "",
        [ToolCall(name="add", arguments={"x": 1})],
    )
    assert chat.parse('{"name": "add", "arguments": {"x": 1}}')[1] == [
        ToolCall(name="add", arguments={"x": 1})
    ]
    assert chat.parse("{the answer}") == ("{the answer}", [])
    assert chat.parse("hello") == ("hello", [])


def test_qwen_renders_consecutive_tool_results_in_one_user_turn() -> None:
    chat = TemplateChat(tokenizer("tokenizer"))
    messages = [
        {"role": "system", "content": "be exact"},
        {"role": "user", "content": "add twice"},
        {"role": "assistant", "content": "", "tool_calls": [call('{"x":1}'), call('{"x":2}')]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
        {"role": "tool", "content": "2", "tool_call_id": "c2"},
    ]
    text = chat.render(messages, [], generate=True)
    assert text == (
        "<|im_start|>system\nbe exact<|im_end|>\n"
        "<|im_start|>user\nadd twice<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"x": 1}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"x": 2}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_tokenizer_of_an_unknown_family_or_without_a_template_is_refused() -> None:
    class Bare:
        chat_template = "{{ messages }}"

        def get_vocab(self) -> dict[str, int]:
            return {"a": 0}

    with pytest.raises(ValueError, match=r"neither <\|im_start\|> \(qwen\) nor"):
        family_of(Bare())
    Bare.chat_template = ""
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        TemplateChat(Bare())


def test_plain_chat_renders_role_lines_and_tools_in_the_qwen_format() -> None:
    tools = [{"type": "function", "function": {"name": "add"}}]
    text = PlainChat().render([{"role": "user", "content": "hi"}], tools, generate=True)
    assert text.startswith("system: # Tools\n\nYou may call") and text.endswith(
        "user: hi\nassistant: "
    )
