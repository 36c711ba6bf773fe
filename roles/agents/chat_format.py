"""How chat messages become the policy's text, and its text becomes a message again, in the
model family's own format.

A ``ChatFormat`` renders a conversation (with the tools the request offers) as the text the
policy reads, and parses what the policy wrote back into a message: its content and its tool
calls. Two formats:

- ``TemplateChat(tokenizer)``: the tokenizer's own chat template
  (``tokenizer.apply_chat_template``), with the tool format of the model family, found from the
  tokenizer's special tokens or named (``family``):

  - ``qwen`` (``<|im_start|>``): the tools are described in the system message inside
    ``<tools></tools>``; a call is
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (several may follow
    one another); a tool's result is a user turn holding
    ``<tool_response>\\n...\\n</tool_response>``
    (the results of consecutive tool messages share one turn), as Qwen2.5's template writes them.
  - ``llama3`` (``<|start_header_id|>``): the tools are described in the first user message, as
    JSON; a call is the JSON object ``{"name": ..., "parameters": {...}}`` as the whole reply
    (one call a turn); a tool's result is an ``ipython`` turn, as Llama 3.1's template writes
    them.

  The calls and results are written into the messages' content in that format before the
  template renders them, so a template that knows nothing of tools (as the tokenizers in
  ``examples/qwen/`` ship) renders them exactly as one that does.

- ``PlainChat``: ``"<role>: <content>\\n"`` per message, then ``"assistant: "``, for a tokenizer
  without a template (character-level test tokenizers); tool calls in the qwen format.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Protocol

import msgspec

__all__ = ["ChatFormat", "PlainChat", "TemplateChat", "ToolCall", "family_of"]


class ToolCall(msgspec.Struct, kw_only=True):
    """A call the policy wrote: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]

    def message(self) -> dict[str, Any]:
        """As an OpenAI ``tool_calls`` entry, with a fresh id."""
        return {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {
                "name": self.name,
                "arguments": msgspec.json.encode(self.arguments).decode(),
            },
        }


class ChatFormat(Protocol):
    """Renders conversations and parses replies in one model family's format."""

    turn_end: str
    """The text that closes an assistant turn in ``render`` (its last occurrence in a rendered
    assistant turn is where the policy's own text ended)."""

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, generate: bool
    ) -> str:
        """The conversation as text; with ``generate``, the assistant's turn opened after it."""
        ...

    def call_prefix(self, name: str | None) -> str:
        """The text that opens a tool call (of function ``name``, or any): what a request whose
        ``tool_choice`` requires a call puts after the opened assistant turn."""
        ...

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """What the policy wrote, as a message's content and its tool calls."""
        ...


def family_of(tokenizer: Any) -> str:
    """The model family of a tokenizer, from its special tokens: ``qwen`` or ``llama3``.

    Raises:
        ValueError: neither family's tokens are in the vocabulary.
    """
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" in vocab:
        return "qwen"
    if "<|start_header_id|>" in vocab:
        return "llama3"
    raise ValueError(
        "the tokenizer is of no family whose tool format the endpoint knows (its vocabulary "
        "has neither <|im_start|> (qwen) nor <|start_header_id|> (llama3)); pass family="
    )


def _dumps(value: Any) -> str:
    """JSON as Python's ``json.dumps`` writes it by default (what the families' templates use)."""
    import json

    return json.dumps(value, ensure_ascii=False)


QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN_TOOLS = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN_TOOLS_END = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

LLAMA_TOOLS = (
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n"
)


def _qwen_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], default_system: str
) -> list[dict[str, str]]:
    """Messages with calls, results and tools written in Qwen's format."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "developer":
            role = "system"
        if role == "assistant" and m.get("tool_calls"):
            for call in m["tool_calls"]:
                f = call["function"]
                body = _dumps({"name": f["name"], "arguments": msgspec.json.decode(f["arguments"])})
                content += ("\n" if content else "") + f"<tool_call>\n{body}\n</tool_call>"
        if role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + result
                continue
            out.append({"role": "user", "content": result, "_tool": "1"})
            continue
        out.append({"role": role, "content": content})
    if tools:
        described = QWEN_TOOLS + "".join("\n" + _dumps(t) for t in tools) + QWEN_TOOLS_END
        if out and out[0]["role"] == "system":
            out[0]["content"] += described
        else:
            out.insert(0, {"role": "system", "content": (default_system + described).lstrip()})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _llama_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, str]]:
    """Messages with calls, results and tools written in Llama 3.1's JSON tool format."""
    out: list[dict[str, str]] = []
    described = not tools
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "developer":
            role = "system"
        if role == "assistant" and m.get("tool_calls"):
            calls = [c["function"] for c in m["tool_calls"]]
            content = " ".join(
                _dumps({"name": f["name"], "parameters": msgspec.json.decode(f["arguments"])})
                for f in calls
            )
        if role == "tool":
            role = "ipython"
        if role == "user" and not described:
            content = LLAMA_TOOLS + "".join(_dumps(t) + "\n\n" for t in tools) + content
            described = True
        out.append({"role": role, "content": content})
    return out


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


def _parse_qwen(text: str) -> tuple[str, list[ToolCall]]:
    calls: list[ToolCall] = []
    for body in QWEN_CALL.findall(text):
        value = _json_object(body)
        if value is None or not isinstance(value.get("name"), str):
            return text, []  # a malformed call: the reply stays text
        arguments = value.get("arguments", {})
        if not isinstance(arguments, dict):
            return text, []
        calls.append(ToolCall(name=value["name"], arguments=arguments))
    if not calls:
        return text, []
    return text[: text.index("<tool_call>")].strip(), calls


def _parse_llama(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    value = _json_object(body) if body.startswith("{") else None
    if value is None or not isinstance(value.get("name"), str):
        return text, []
    arguments = value.get("parameters", value.get("arguments", {}))
    if not isinstance(arguments, dict):
        return text, []
    return "", [ToolCall(name=value["name"], arguments=arguments)]


class TemplateChat:
    """The tokenizer's chat template with its family's tool format (see the module).

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template.
        family: ``qwen`` or ``llama3``; None: ``family_of(tokenizer)``.

    Raises:
        ValueError: the tokenizer has no chat template, or its family is unknown.
    """

    def __init__(self, tokenizer: Any, family: str | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template (tokenizer.chat_template is empty); give "
                "it one, or serve it with PlainChat"
            )
        self.tokenizer = tokenizer
        self.family = family or family_of(tokenizer)
        if self.family not in ("qwen", "llama3"):
            raise ValueError(f"family: expected 'qwen' or 'llama3', got {self.family!r}")
        self.turn_end = "<|im_end|>" if self.family == "qwen" else "<|eot_id|>"

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, generate: bool
    ) -> str:
        if self.family == "qwen":
            shaped = _qwen_messages(messages, tools, QWEN_SYSTEM)
        else:
            shaped = _llama_messages(messages, tools)
        text = self.tokenizer.apply_chat_template(
            shaped, tokenize=False, add_generation_prompt=generate
        )
        return str(text)

    def call_prefix(self, name: str | None) -> str:
        if self.family == "qwen":
            return "<tool_call>\n" + (
                '{"name": ' + _dumps(name) + ', "arguments": ' if name else ""
            )
        return '{"name": ' + (_dumps(name) + ', "parameters": ' if name else "")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return _parse_qwen(text) if self.family == "qwen" else _parse_llama(text)


class PlainChat:
    """``"<role>: <content>\\n"`` per message, then ``"assistant: "``; tool calls, results and
    tools in the qwen format (see the module)."""

    turn_end = "\n"

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, generate: bool
    ) -> str:
        shaped = _qwen_messages(messages, tools, "")
        text = "".join(f"{m['role']}: {m['content']}\n" for m in shaped)
        return text + ("assistant: " if generate else "")

    def call_prefix(self, name: str | None) -> str:
        return "<tool_call>\n" + ('{"name": ' + _dumps(name) + ', "arguments": ' if name else "")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return _parse_qwen(text)
