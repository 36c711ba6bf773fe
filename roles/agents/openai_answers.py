"""The shapes of OpenAI's answers: a choice's log-probs in each API's form, its text as a
stream sends it, the assistant message and the usage counts."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from asyncrl.roles.agents.openai_episodes import Choice

__all__ = ["Answers", "reply", "usage"]


class Answers:
    """A choice's parts as the API answers them.

    Args:
        decode: token ids -> text.
        stop_token_ids: the tokens that end a completion (never shown).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop_token_ids: list[int]) -> None:
        self.decode = decode
        self.stop_token_ids = stop_token_ids

    def shown_tokens(self, c: Choice) -> list[int]:
        """The choice's tokens without the stop token it ended with."""
        tokens = c.token_ids
        return tokens[:-1] if tokens and tokens[-1] in self.stop_token_ids else tokens

    def chat_logprobs(self, c: Choice) -> dict[str, Any]:
        """The chat API's ``logprobs``: each shown token's behaviour log-prob."""
        tokens = self.shown_tokens(c)
        return {
            "content": [
                {
                    "token": (piece := self.decode([t])),
                    "logprob": lp,
                    "bytes": list(piece.encode()),
                    "top_logprobs": [],
                }
                for t, lp in zip(tokens, c.logprobs, strict=False)
            ],
            "refusal": None,
        }

    def text_logprobs(self, c: Choice) -> dict[str, Any]:
        """The completions API's ``logprobs``: each shown token, its log-prob and offset."""
        tokens = self.shown_tokens(c)
        pieces = [self.decode([t]) for t in tokens]
        offsets = list(itertools.accumulate((len(p) for p in pieces), initial=0))[:-1]
        return {
            "tokens": pieces,
            "token_logprobs": c.logprobs[: len(tokens)],
            "top_logprobs": None,
            "text_offset": offsets,
        }

    def pieces(self, c: Choice) -> list[str]:
        """The choice's text split as a stream sends it: piece ``i`` is what shown token ``i``
        added to the text (empty when it added nothing visible yet); they join to the text."""
        tokens = self.shown_tokens(c)
        out: list[str] = []
        before = ""
        for t in range(1, len(tokens) + 1):
            now = self.decode(tokens[:t])[: len(c.text)]
            if len(now) > len(before) and c.text.startswith(now):
                out.append(now[len(before) :])
                before = now
            else:
                out.append("")
        rest = c.text[len(before) :]
        if rest:  # text that decoding the tokens one by one did not reach
            out[-1:] = [(out[-1] if out else "") + rest]
        return out


def reply(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as the API answers it (content null beside tool calls)."""
    out = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
        out["content"] = message["content"] or None
    return out


def usage(prompt: list[int], choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": completion,
        "total_tokens": len(prompt) + completion,
    }
