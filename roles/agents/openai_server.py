"""An OpenAI-compatible endpoint in front of the rollout group, so that agent code written
against an OpenAI client runs unchanged during RL.

``OpenAIServer`` serves, on aiohttp:

- ``POST /v1/completions``: ``prompt`` (text, or a list of token ids), ``max_tokens`` (or
  ``max_completion_tokens``, which newer clients send), ``temperature``, ``top_p``;
- ``POST /v1/chat/completions``: ``messages`` rendered by ``render`` (by default
  ``"<role>: <content>\\n"`` per message, then ``"assistant: "``), the same sampling fields;
- ``GET /v1/models``: the one model, ``model_name``.

Each request goes to the rollout group through the program's handle (the dispatcher picks a
replica; any engine), as one sample. A request is tied to an episode by the ``X-Episode-Id``
header or the body's ``user`` field; for each episode the server records the exact token ids,
behaviour log-probs and weight versions of every completion, and ``trajectory(episode_id)``
assembles them into the ``Trajectory`` the learner trains: what the policy generated (masked in)
and everything between its completions (masked out).

The text is never re-tokenized where it matters: in a chat request, an assistant message equal to
the episode's next recorded completion is replaced by that completion's own token ids, so the
context the policy sees next, and the trajectory, hold exactly the tokens it generated. Only the
other messages (system, user, tool) are tokenized. A completion request whose prompt text starts
with the episode's last prompt and completion as the agent was shown them (the agent appended to
what it was given) reuses those tokens, the completion's stop token included, the same way.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from typing import Any

import msgspec

try:
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "asyncrl.roles.agents.openai_server needs aiohttp: pip install 'asyncrl[agents]'"
    ) from exc

from asyncrl.roles.agents.episodes import Segment, Trajectory
from asyncrl.roles.payloads import GenerateBatch, GenerateRequest, Prompt, Sample, SamplingParams

__all__ = ["Completion", "OpenAIServer", "plain_chat"]

EPISODE_HEADER = "X-Episode-Id"


class Completion(msgspec.Struct, kw_only=True):
    """One completion of an episode, as the policy produced it, and the reward the agent gave
    it (``OpenAIServer.reward``)."""

    id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    reward: float = 0.0


def plain_chat(role: str, content: str) -> str:
    """The default chat rendering of one message."""
    return f"{role}: {content}\n"


class OpenAIServer:
    """Serves OpenAI's completion APIs from the rollout group (see the module).

    Args:
        rollout: the rollout group's handle.
        encode: text -> token ids; decode: token ids -> text.
        model_name: the model the API names.
        stop_token_ids: tokens that end every completion (the end-of-sequence id).
        render: how a chat message is rendered as text (``plain_chat``).
        assistant_prefix: the text that opens the assistant's turn.
        max_tokens: the default ``max_tokens``.
        timeout_s: the deadline of one generate call.
    """

    def __init__(
        self,
        rollout: Any,
        *,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        model_name: str = "policy",
        stop_token_ids: list[int] | None = None,
        render: Callable[[str, str], str] = plain_chat,
        assistant_prefix: str = "assistant: ",
        max_tokens: int = 64,
        timeout_s: float = 600.0,
    ) -> None:
        self.rollout = rollout
        self.encode = encode
        self.decode = decode
        self.model_name = model_name
        self.stop_token_ids = list(stop_token_ids or [])
        self.render = render
        self.assistant_prefix = assistant_prefix
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.episodes: dict[str, list[Completion]] = {}
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: a free port); the base URL (``http://host:port/v1``)."""
        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.get("/v1/models", self._models),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        self.url = f"http://{bound[0]}:{bound[1]}/v1"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> OpenAIServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the trajectory ------------------------------------------------------------------

    def reward(self, episode_id: str, value: float, *, completion: str | None = None) -> None:
        """Give the episode's completion ``completion`` (the ``id`` of the response that
        returned it; by default the episode's latest) the reward ``value``, added to what it was
        given before. It is that turn's entry of the trajectory's ``turn_rewards``.

        Raises:
            KeyError: no completion was recorded for the episode, or none with that id.
            ValueError: ``value`` is not a finite number.
        """
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"reward of episode {episode_id!r}: expected a finite number, got {value!r}")
        completions = self.episodes[episode_id]
        if completion is None:
            target = completions[-1]
        else:
            found = [c for c in completions if c.id == completion]
            if not found:
                raise KeyError(
                    f"episode {episode_id!r} has no completion {completion!r}; its completions "
                    f"are {[c.id for c in completions]}"
                )
            target = found[0]
        target.reward += float(value)

    def trajectory(self, episode_id: str, reward: float = 0.0, done: bool = True) -> Trajectory:
        """The episode's completions as one trajectory: its first prompt, then, for each
        completion, what came between it and the previous one (masked out) and the completion
        itself (masked in). ``turn_rewards`` holds each completion's reward (``reward``), the
        last one's plus ``reward``, the episode's final reward; the trajectory's ``reward`` is
        their sum, which the episode scorer (``episode_rewards``) reads.

        Raises:
            KeyError: no completion was recorded for the episode.
            ValueError: a completion's prompt does not extend the previous context (the agent
                rewrote its history), so no single trajectory holds them.
        """
        completions = self.episodes[episode_id]
        first = completions[0]
        traj = Trajectory(episode_id=episode_id, prompt_ids=list(first.prompt_ids))
        context = list(first.prompt_ids)
        for i, c in enumerate(completions):
            if c.prompt_ids[: len(context)] != context:
                raise ValueError(
                    f"episode {episode_id!r}: completion {i}'s prompt does not extend the "
                    "previous context; the agent rewrote its history"
                )
            between = c.prompt_ids[len(context) :]
            if between:
                traj.segments.append(Segment(policy=False, token_ids=between))
            traj.segments.append(
                Segment(
                    policy=True,
                    token_ids=list(c.token_ids),
                    logprobs=list(c.logprobs),
                    versions=list(c.versions),
                )
            )
            context = [*c.prompt_ids, *c.token_ids]
        traj.turn_rewards = [c.reward for c in completions]
        traj.turn_rewards[-1] += reward
        traj.reward = sum(traj.turn_rewards)
        traj.done = done
        return traj

    # -- handlers -----------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}
        )

    async def _completions(self, request: web.Request) -> web.Response:
        body, episode = await self._body(request)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, str):
            ids = self._reuse(episode, prompt)
        else:
            raise _bad("prompt: expected a string or a list of token ids")
        c = await self._generate(ids, body, episode)
        return web.json_response(
            {
                **self._head("text_completion", c.id),
                "choices": [
                    {"index": 0, "text": c.text, "finish_reason": c.finish, "logprobs": None}
                ],
                "usage": _usage(ids, c.token_ids),
            }
        )

    async def _chat(self, request: web.Request) -> web.Response:
        body, episode = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages: expected a non-empty list of {role, content}")
        ids = self._chat_ids(messages, episode)
        c = await self._generate(ids, body, episode)
        return web.json_response(
            {
                **self._head("chat.completion", c.id),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": c.text},
                        "finish_reason": c.finish,
                    }
                ],
                "usage": _usage(ids, c.token_ids),
            }
        )

    # -- the work -----------------------------------------------------------------------

    def _chat_ids(self, messages: list[Any], episode: str) -> list[int]:
        """The context of a chat request: each message rendered and tokenized, except an
        assistant message equal to the episode's next recorded completion, which is that
        completion's own tokens."""
        recorded = iter(self.episodes.get(episode, []))
        pending = next(recorded, None)
        ids: list[int] = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise _bad("messages: each needs a role and a string content")
            role = str(m.get("role", "user"))
            if role == "assistant" and pending is not None and m["content"] == pending.text:
                ids += self.encode(self.assistant_prefix) + pending.token_ids + self.encode("\n")
                pending = next(recorded, None)
            else:
                ids += self.encode(self.render(role, m["content"]))
        return ids + self.encode(self.assistant_prefix)

    def _reuse(self, episode: str, prompt: str) -> list[int]:
        """A completion prompt's ids: the episode's last context and completion as recorded
        when the text starts with them, and only the rest tokenized."""
        last = self.episodes.get(episode, [])[-1:] if episode else []
        if last:
            done = [*last[0].prompt_ids, *last[0].token_ids]
            text = self.decode(last[0].prompt_ids) + last[0].text  # as the agent was shown it
            if prompt.startswith(text):
                return done + self.encode(prompt[len(text) :])
        return self.encode(prompt)

    async def _generate(self, ids: list[int], body: dict[str, Any], episode: str) -> _Done:
        params = SamplingParams(
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            max_new_tokens=int(
                body.get("max_completion_tokens") or body.get("max_tokens") or self.max_tokens
            ),
            stop_token_ids=self.stop_token_ids,
        )
        n = next(self._ids)
        completion_id = f"asyncrl-{n}"
        prompt = Prompt(id=f"{episode or 'openai'}/{n}", token_ids=ids)
        request = GenerateRequest(prompt=prompt, sample_index=0, params=params)
        while True:
            sample: Sample
            (sample,) = await self.rollout.call(
                "generate",
                GenerateBatch([request]),
                list[Sample],
                timeout=self.timeout_s,
                key=(prompt.id, 0),
            )
            if sample.finished:
                break
            request = GenerateRequest(prompt=prompt, sample_index=0, params=params, partial=sample)
        tokens = list(sample.token_ids)
        shown = tokens[:-1] if tokens and tokens[-1] in self.stop_token_ids else tokens
        text = self.decode(shown)
        if episode:
            self.episodes.setdefault(episode, []).append(
                Completion(
                    id=completion_id,
                    prompt_ids=ids,
                    token_ids=tokens,
                    logprobs=list(sample.logprobs),
                    versions=list(sample.versions),
                    text=text,
                )
            )
        finish = "stop" if sample.stop_reason == "stop" else "length"
        return _Done(completion_id, text, tokens, finish)

    async def _body(self, request: web.Request) -> tuple[dict[str, Any], str]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise _bad(f"the body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        episode = request.headers.get(EPISODE_HEADER) or str(body.get("user") or "")
        return body, episode

    def _head(self, kind: str, completion_id: str) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
        }


class _Done:
    def __init__(self, completion_id: str, text: str, token_ids: list[int], finish: str) -> None:
        self.id, self.text, self.token_ids, self.finish = completion_id, text, token_ids, finish


def _usage(prompt: list[int], completion: list[int]) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(completion),
        "total_tokens": len(prompt) + len(completion),
    }


def _bad(message: str) -> web.HTTPBadRequest:
    """A 400 with OpenAI's error body."""
    body = msgspec.json.encode({"error": {"message": message, "type": "invalid_request_error"}})
    return web.HTTPBadRequest(text=body.decode(), content_type="application/json")
