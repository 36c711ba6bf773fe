"""The request bodies the OpenAI-compatible endpoint accepts, checked field by field.

``chat_request`` and ``completion_request`` turn a decoded JSON body into a typed request, or
raise ``RequestError`` (an HTTP 400 in OpenAI's error format) that names the field, the bad
value and what is accepted. A field the endpoint does not implement is refused by name, never
ignored; a field it knows but cannot honour with the value given (``top_logprobs`` above 0, a
``presence_penalty`` other than 0) is refused the same way. ``null`` stands for a field left
out. Bounds that depend on the prompt (the model's context) are checked by the server once the
prompt is tokenized.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

__all__ = [
    "MAX_N",
    "MAX_STOP",
    "ChatRequest",
    "CompletionRequest",
    "RequestError",
    "chat_request",
    "completion_request",
    "normal_message",
]

MAX_N = 16
"""The most choices one request may ask for."""

MAX_STOP = 4
"""The most stop strings one request may give (OpenAI's limit)."""

MAX_STOP_CHARS = 256
"""The longest stop string."""

SAMPLING = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n"}
SAMPLING |= {"stop", "stream", "stream_options", "user", "seed"}
NEUTRAL = {
    # fields the endpoint accepts only at the value that changes nothing
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
    "store": False,
}
CHAT_FIELDS = SAMPLING | {"messages", "logprobs", "top_logprobs", "tools", "tool_choice"}
CHAT_FIELDS |= {"parallel_tool_calls"}
CHAT_FIELDS |= set(NEUTRAL) | {"response_format"}
COMPLETION_FIELDS = SAMPLING | {"prompt", "logprobs", "echo", "suffix", "best_of"}
COMPLETION_FIELDS |= set(NEUTRAL) - {"store"}

ROLES = ("system", "developer", "user", "assistant", "tool")
ASSISTANT_NULLS = {"refusal", "audio", "function_call", "reasoning_content"}
"""Fields of an assistant message a client sends back as null (the ``openai`` client's
``ChatCompletionMessage`` has the first three, verifiers adds ``reasoning_content``): accepted
when null, refused otherwise."""
MESSAGE_FIELDS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", *ASSISTANT_NULLS},
    "tool": {"role", "content", "tool_call_id"},
}


class RequestError(Exception):
    """A request the endpoint refuses: HTTP ``status`` with OpenAI's error body (``message``,
    ``param``: the field, ``code``)."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


class Sampling(msgspec.Struct, kw_only=True):
    """What both APIs share: how to sample, how many choices, how to answer."""

    model: str
    max_tokens: int | None = None  # None: the server's default, bounded by the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: list[str] = []
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    logprobs: bool = False
    user: str = ""


class ChatRequest(Sampling, kw_only=True):
    """A checked ``/v1/chat/completions`` body; ``messages`` in ``normal_message`` form."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"  # "auto", "none", "required" or a named function
    parallel_tool_calls: bool = True


class CompletionRequest(Sampling, kw_only=True):
    """A checked ``/v1/completions`` body: the prompt as text or as token ids."""

    prompt: str | list[int]


def _given(body: dict[str, Any], name: str) -> bool:
    return body.get(name) is not None


def _unknown(body: dict[str, Any], allowed: set[str], api: str) -> None:
    for name in body:
        if name not in allowed:
            raise RequestError(
                f"{name}: the {api} endpoint does not support this field; leave it out "
                f"(supported: {', '.join(sorted(allowed))})",
                param=name,
                code="unsupported_field",
            )
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if value is not None and name in allowed and value != neutral:
            raise RequestError(
                f"{name}: only {msgspec.json.encode(neutral).decode()} is supported, got "
                f"{_show(value)}",
                param=name,
                code="unsupported_value",
            )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _integer(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name}: expected an integer >= {low}, got {_show(value)}", param=name)
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise RequestError(f"{name}: expected an integer {bound}, got {value}", param=name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float, *, open_low: bool) -> float:
    value = body.get(name)
    if value is None:
        return 1.0
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > low if open_low else value >= low) and value <= high:
        return float(value)
    interval = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
    raise RequestError(f"{name}: expected a number in {interval}, got {_show(value)}", param=name)


def _sampling(body: dict[str, Any], api: str) -> dict[str, Any]:
    """The fields both APIs share, checked."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(f"model: expected the model's name, got {_show(model)}", param="model")
    tokens = _integer(body, "max_tokens", 1)
    newer = _integer(body, "max_completion_tokens", 1)
    if tokens is not None and newer is not None and tokens != newer:
        raise RequestError(
            f"max_tokens ({tokens}) and max_completion_tokens ({newer}) differ; send one",
            param="max_completion_tokens",
        )
    if _given(body, "seed"):
        raise RequestError(
            "seed: the rollout group samples with its own generators and cannot reproduce a "
            "seeded sample; leave seed out",
            param="seed",
            code="unsupported_value",
        )
    stop = body.get("stop")
    stops: list[str] = []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    elif stop is not None:
        raise RequestError(
            f"stop: expected a string or a list of strings, got {_show(stop)}", param="stop"
        )
    if len(stops) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(
            f"stop: expected at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} "
            f"characters, got {_show(stop)}",
            param="stop",
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"stream: expected true or false, got {_show(stream)}", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError(
                "stream_options: only allowed with stream: true", param="stream_options"
            )
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError(
                f"stream_options: only include_usage is supported, got {_show(options)}",
                param="stream_options",
            )
        include_usage = bool(options.get("include_usage"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(f"user: expected a string, got {_show(user)}", param="user")
    return {
        "model": model,
        "max_tokens": newer if newer is not None else tokens,
        "temperature": _temperature(body),
        "top_p": _number(body, "top_p", 0.0, 1.0, open_low=True),
        "top_k": _integer(body, "top_k", 0) or 0,
        "n": _integer(body, "n", 1, MAX_N) or 1,
        "stop": stops,
        "stream": bool(stream),
        "include_usage": include_usage,
        "user": user or "",
    }


def _temperature(body: dict[str, Any]) -> float:
    if body.get("temperature") is None:
        return 1.0
    return _number(body, "temperature", 0.0, 2.0, open_low=False)


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """A ``/v1/chat/completions`` body, checked.

    Raises:
        RequestError: a field is unsupported or holds a bad value (the message names it).
    """
    _unknown(body, CHAT_FIELDS, "chat completions")
    fields = _sampling(body, "chat")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError(
            f"logprobs: expected true or false, got {_show(logprobs)}", param="logprobs"
        )
    top = _integer(body, "top_logprobs", 0, 20)
    if top:
        raise RequestError(
            f"top_logprobs: the rollout returns the log-prob of the sampled token only, not "
            f"the {top} most likely; send 0 or leave it out",
            param="top_logprobs",
            code="unsupported_value",
        )
    if top is not None and not logprobs:
        raise RequestError("top_logprobs: only allowed with logprobs: true", param="top_logprobs")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise RequestError(
            f"response_format: only {{'type': 'text'}} is supported (no constrained decoding), "
            f"got {_show(response_format)}",
            param="response_format",
            code="unsupported_value",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            "messages: expected a non-empty list of messages ({role, content})", param="messages"
        )
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(
            f"parallel_tool_calls: expected true or false, got {_show(parallel)}",
            param="parallel_tool_calls",
        )
    return ChatRequest(
        **fields,
        logprobs=bool(logprobs),
        messages=[normal_message(m, i) for i, m in enumerate(messages)],
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel is None or bool(parallel),
    )


def completion_request(body: dict[str, Any]) -> CompletionRequest:
    """A ``/v1/completions`` body, checked.

    Raises:
        RequestError: a field is unsupported or holds a bad value (the message names it).
    """
    _unknown(body, COMPLETION_FIELDS, "completions")
    fields = _sampling(body, "completions")
    for name, neutral in (("echo", False), ("suffix", None), ("best_of", 1)):
        value = body.get(name)
        if value is not None and value != neutral:
            raise RequestError(
                f"{name}: only {msgspec.json.encode(neutral).decode()} is supported, got "
                f"{_show(value)}",
                param=name,
                code="unsupported_value",
            )
    logprobs = _integer(body, "logprobs", 0, 5)
    if logprobs:
        raise RequestError(
            f"logprobs: the rollout returns the log-prob of the sampled token only, not the "
            f"{logprobs} most likely; send 0 for the sampled tokens' log-probs",
            param="logprobs",
            code="unsupported_value",
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        ids: str | list[int] = list(prompt)
    elif isinstance(prompt, str) and prompt:
        ids = prompt
    else:
        raise RequestError(
            "prompt: expected a non-empty string or a non-empty list of token ids (a batch of "
            f"several prompts is not supported), got {_show(prompt)}",
            param="prompt",
        )
    return CompletionRequest(**fields, logprobs=logprobs is not None, prompt=ids)


def _text_content(content: Any, where: str) -> str:
    """A message's content as one string: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    f"{where}.content[{j}]: only text parts ({{type: 'text', text}}) are "
                    f"supported, got {_show(kind)}",
                    param=f"{where}.content",
                    code="unsupported_value",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(
                    f"{where}.content[{j}].text: expected a string, got {_show(text)}",
                    param=f"{where}.content",
                )
            parts.append(text)
        return "".join(parts)
    raise RequestError(
        f"{where}.content: expected a string or a list of text parts, got {_show(content)}",
        param=f"{where}.content",
    )


def normal_message(message: Any, index: int) -> dict[str, Any]:
    """One chat message checked and in the form the endpoint compares and renders: ``role``,
    ``content`` (a string; list of text parts joined; "" when an assistant's is null), ``name``
    when given, an assistant's ``tool_calls`` as ``[{id, type, function: {name,
    arguments}}]`` with ``arguments`` a JSON string, a tool message's ``tool_call_id``.

    Raises:
        RequestError: the message is malformed or uses what the endpoint does not support.
    """
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where}: expected an object, got {_show(message)}", param="messages")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(
            f"{where}.role: expected one of {', '.join(ROLES)}, got {_show(role)}",
            param="messages",
        )
    for name, value in message.items():
        if name not in MESSAGE_FIELDS[role]:
            raise RequestError(
                f"{where}.{name}: {'an' if role[0] in 'aeiou' else 'a'} {role} message does not "
                "support this field",
                param="messages",
                code="unsupported_field",
            )
        if name in ASSISTANT_NULLS and value is not None:
            raise RequestError(
                f"{where}.{name}: not supported (send null or leave it out)",
                param="messages",
                code="unsupported_value",
            )
    out: dict[str, Any] = {"role": role}
    content = message.get("content")
    calls = message.get("tool_calls") if role == "assistant" else None
    if content is None and role == "assistant":
        if not calls:
            raise RequestError(
                f"{where}: an assistant message needs a content or tool_calls", param="messages"
            )
        out["content"] = ""
    else:
        out["content"] = _text_content(content, where)
    if message.get("name") is not None:
        if not isinstance(message["name"], str):
            raise RequestError(f"{where}.name: expected a string", param="messages")
        out["name"] = message["name"]
    if calls:
        out["tool_calls"] = _tool_calls(calls, where)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise RequestError(
                f"{where}.tool_call_id: a tool message needs the id of the call it answers, "
                f"got {_show(call_id)}",
                param="messages",
            )
        out["tool_call_id"] = call_id
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls: expected a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
            or not isinstance(call.get("id"), str)
        ):
            raise RequestError(
                f"{at}: expected {{id, type: 'function', function: {{name, arguments: a JSON "
                f"string}}}}, got {_show(call)}",
                param="messages",
            )
        try:
            arguments = msgspec.json.decode(function["arguments"])
        except msgspec.DecodeError as exc:
            raise RequestError(
                f"{at}.function.arguments: not JSON ({exc})", param="messages"
            ) from exc
        out.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {
                    "name": function["name"],
                    "arguments": msgspec.json.encode(arguments).decode(),
                },
            }
        )
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError(f"tools: expected a list, got {_show(tools)}", param="tools")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise RequestError(
                f"tools[{i}]: expected {{type: 'function', function: {{name, description, "
                f"parameters}}}}, got {_show(tool)}",
                param="tools",
            )
        out.append({"type": "function", "function": dict(function)})
    return out


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise RequestError("tool_choice: 'required' needs tools", param="tool_choice")
        return str(choice)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and choice.get("type") == "function" and name in names:
        return {"type": "function", "function": {"name": name}}
    raise RequestError(
        f"tool_choice: expected 'auto', 'none', 'required' or {{type: 'function', function: "
        f"{{name}}}} naming one of the tools {names}, got {_show(choice)}",
        param="tool_choice",
    )
