"""An OpenAI-compatible endpoint in front of the rollout group, so that agent code written
against an OpenAI client runs unchanged during RL.

``OpenAIServer`` serves, on aiohttp, to holders of its API key (a bearer token, the ``openai``
client's ``api_key``; 401 without it):

- ``POST /v1/chat/completions``: ``messages`` rendered by the chat format (the tokenizer's chat
  template, ``asyncrl.roles.agents.chat_format``), ``tools``/``tool_choice`` and ``tool_calls``
  in the model family's own format, ``n``, ``stop``, ``logprobs``, ``stream``;
- ``POST /v1/completions``: ``prompt`` as text or as token ids, the same sampling fields;
- ``GET /v1/models``: the one model, ``model_name``.

Every request is checked before it reaches the rollout (``asyncrl.roles.agents.openai_requests``):
an unsupported field or a bad value is a 400 naming it, and so is a prompt or a ``max_tokens``
past the model's context. Each choice goes to the rollout group through the program's handle as
one sample (the dispatcher picks a replica; any engine).

**Episodes.** A request is tied to an episode by the ``X-Episode-Id`` header or the body's
``user`` field, and to a branch of it by ``X-Episode-Branch`` (``main`` by default). For each
branch the server records the exact token ids, behaviour log-probs and weight versions of every
completion, and ``trajectory(episode_id, branch=...)`` assembles them into the ``Trajectory``
the learner trains: what the policy generated (masked in) and everything between its
completions (masked out). The text is never re-tokenized where it matters: each request of a
branch must extend the branch's history exactly (the previous request's messages, then the
assistant message it returned, then anything), and its context is then the recorded tokens of
that history followed by the tokens of what it adds. A request that does not extend it is
refused at once (409, the first differing message and its text), and a request that does not
even start as the branch's first one did is refused as a reused episode id. A new branch may
start anywhere: it reuses the recorded tokens of the deepest completion of the episode its
history extends, and its trajectory holds only its own completions.

``close(episode_id)`` forgets an episode; one left idle for ``idle_timeout_s`` is forgotten
too. A request to a forgotten episode is refused (409), so a late agent never starts a fresh
trajectory under an old id.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import itertools
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec

try:
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "asyncrl.roles.agents.openai_server needs aiohttp: pip install 'asyncrl[agents]'"
    ) from exc

from asyncrl.roles.agents.chat_format import ChatFormat, PlainChat, TemplateChat
from asyncrl.roles.agents.episodes import Segment, Trajectory
from asyncrl.roles.agents.openai_requests import (
    ChatRequest,
    CompletionRequest,
    RequestError,
    chat_request,
    completion_request,
    normal_message,
)
from asyncrl.roles.payloads import GenerateBatch, GenerateRequest, Prompt, Sample, SamplingParams
from asyncrl.transport.control import run_api_key

__all__ = [
    "BRANCH_HEADER",
    "EPISODE_HEADER",
    "Choice",
    "Completion",
    "Episode",
    "OpenAIServer",
]

EPISODE_HEADER = "X-Episode-Id"
BRANCH_HEADER = "X-Episode-Branch"
MAIN = "main"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
FORGOTTEN_KEPT = 100_000
"""How many forgotten episode ids the server remembers, to refuse their reuse."""


class Choice(msgspec.Struct, kw_only=True):
    """One choice of a completion, as the policy produced it and as the agent was shown it."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str  # what the agent was shown as text (before a tool call was parsed out)
    message: dict[str, Any] = {}  # the chat API's assistant message, as normal_message has it
    finish: str = "stop"


class Completion(msgspec.Struct, kw_only=True):
    """One request of an episode's branch: its context, its choices, which of them the branch
    went on with (the first, until a later request's history names another), and the reward the
    agent gave it (``OpenAIServer.reward``)."""

    id: str
    prompt_ids: list[int]
    choices: list[Choice]
    chosen: int = 0
    reward: float = 0.0
    prompt_text: str = ""  # the completions API's prompt as sent
    messages: list[dict[str, Any]] | None = None  # the chat API's, as normal_message has them
    tools: list[dict[str, Any]] = []

    @property
    def choice(self) -> Choice:
        return self.choices[self.chosen]

    @property
    def token_ids(self) -> list[int]:
        return self.choice.token_ids

    @property
    def text(self) -> str:
        return self.choice.text


class Episode:
    """What the server holds of one episode: its branches' completions, in order."""

    def __init__(self, episode_id: str, now: float) -> None:
        self.id = episode_id
        self.branches: dict[str, list[Completion]] = {}
        self.touched = now
        self.busy: set[str] = set()  # branches with a request in flight


class _Base(msgspec.Struct):
    """A recorded completion (and choice) a request's history extends."""

    completion: Completion
    choice: int


class OpenAIServer:
    """Serves OpenAI's completion APIs from the rollout group (see the module).

    Args:
        rollout: the rollout group's handle.
        context_length: the model's context, in tokens: a prompt and its ``max_tokens``
            together must fit in it.
        tokenizer: a ``transformers`` tokenizer: its ``encode``/``decode``, its chat template
            (``TemplateChat``) and its end-of-sequence id as the stop token. Or, without one:
        encode: text -> token ids; decode: token ids -> text (with ``PlainChat``).
        chat: how chat messages become text and replies become messages (a ``ChatFormat``).
        model_name: the model the API names; a request naming another is refused (404).
        stop_token_ids: tokens that end every completion (by default the tokenizer's EOS).
        max_tokens: the ``max_tokens`` of a request that gives none (bounded by the context).
        api_key: the key every request must present; None: the run's (``ctx.api_key``,
            written into ``RUN_DIR/api_key``), or a fresh random one outside a run.
        timeout_s: the deadline of one generate call.
        idle_timeout_s: an episode without a request for this long is forgotten.
        max_body_bytes: the largest request body.
        clock: monotonic seconds (tests pass a fake one).

    Raises:
        ValueError: neither a tokenizer nor encode and decode, or a bad number.
    """

    def __init__(
        self,
        rollout: Any,
        *,
        context_length: int,
        tokenizer: Any = None,
        encode: Callable[[str], list[int]] | None = None,
        decode: Callable[[list[int]], str] | None = None,
        chat: ChatFormat | None = None,
        model_name: str = "policy",
        stop_token_ids: list[int] | None = None,
        max_tokens: int = 256,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        idle_timeout_s: float = 3600.0,
        max_body_bytes: int = 16 * 2**20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if tokenizer is not None:
            self.encode = encode or (lambda t: tokenizer.encode(t, add_special_tokens=False))
            self.decode = decode or (lambda ids: tokenizer.decode(ids))
            if chat is None:
                chat = TemplateChat(tokenizer) if tokenizer.chat_template else PlainChat()
            if stop_token_ids is None and tokenizer.eos_token_id is not None:
                stop_token_ids = [tokenizer.eos_token_id]
        elif encode is None or decode is None:
            raise ValueError("OpenAIServer needs a tokenizer, or both encode and decode")
        else:
            self.encode, self.decode = encode, decode
        for name, value in (("context_length", context_length), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s: expected seconds > 0, got {idle_timeout_s}")
        self.rollout = rollout
        self.chat: ChatFormat = chat or PlainChat()
        self.context_length = context_length
        self.model_name = model_name
        self.stop_token_ids = list(stop_token_ids or [])
        self.max_tokens = max_tokens
        self.api_key = api_key or run_api_key() or secrets.token_hex(20)
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_body_bytes = max_body_bytes
        self.clock = clock
        self.episodes: dict[str, Episode] = {}
        self._forgotten: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.url = ""

    # -- lifetime -----------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, remote: bool = False) -> str:
        """Listen on ``host:port`` (0: a free port); the base URL (``http://host:port/v1``).

        Raises:
            ValueError: ``host`` is not a loopback address and ``remote`` is not set: any
                machine that reaches it could then try the key.
        """
        if host not in LOOPBACK and not remote:
            raise ValueError(
                f"host {host!r} is not a loopback address: pass remote=True to listen there "
                "(requests still need the API key, sent in clear over HTTP)"
            )
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._guard])
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
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"http://{shown}:{bound[1]}/v1"
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return self.url

    async def close_server(self) -> None:
        """Stop listening; the episodes stay readable."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> OpenAIServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close_server()

    # -- episodes -----------------------------------------------------------------------

    def close(self, episode_id: str) -> None:
        """Forget the episode; a later request naming it is refused (409).

        Raises:
            KeyError: the server holds no such episode.
        """
        del self.episodes[episode_id]
        self._forget(episode_id, "was closed")

    def evict_idle(self) -> list[str]:
        """Forget every episode without a request for ``idle_timeout_s`` and none in flight
        (the server does this by itself every few seconds); the ids forgotten."""
        now = self.clock()
        idle = [
            e.id
            for e in self.episodes.values()
            if not e.busy and now - e.touched >= self.idle_timeout_s
        ]
        for episode_id in idle:
            del self.episodes[episode_id]
            self._forget(episode_id, f"was idle for {self.idle_timeout_s:g} s and forgotten")
        return idle

    def _forget(self, episode_id: str, why: str) -> None:
        self._forgotten[episode_id] = why
        self._forgotten.move_to_end(episode_id)
        while len(self._forgotten) > FORGOTTEN_KEPT:
            self._forgotten.popitem(last=False)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(self.idle_timeout_s / 4, 30.0))
            self.evict_idle()

    def reward(
        self, episode_id: str, value: float, *, completion: str | None = None, branch: str = MAIN
    ) -> None:
        """Give the branch's completion ``completion`` (the ``id`` of the response that
        returned it; by default the branch's latest) the reward ``value``, added to what it was
        given before. It is that turn's entry of the trajectory's ``turn_rewards``.

        Raises:
            KeyError: no completion was recorded for the episode's branch, or none with that id.
            ValueError: ``value`` is not a finite number.
        """
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ValueError(
                f"reward of episode {episode_id!r}: expected a finite number, got {value!r}"
            )
        completions = self._branch(episode_id, branch)
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

    def _branch(self, episode_id: str, branch: str) -> list[Completion]:
        episode = self.episodes.get(episode_id)
        if episode is None:
            why = self._forgotten.get(episode_id)
            raise KeyError(f"episode {episode_id!r} {why}" if why else f"no episode {episode_id!r}")
        if branch not in episode.branches:
            raise KeyError(
                f"episode {episode_id!r} has no branch {branch!r}; its branches are "
                f"{sorted(episode.branches)}"
            )
        return episode.branches[branch]

    def trajectory(
        self, episode_id: str, reward: float = 0.0, done: bool = True, *, branch: str = MAIN
    ) -> Trajectory:
        """The branch's completions as one trajectory: its first prompt, then, for each
        completion, what came between it and the previous one (masked out) and the completion
        itself (masked in; of a request with several choices, the one the next request went on
        with). ``turn_rewards`` holds each completion's reward (``reward``), the last one's plus
        ``reward``, the episode's final reward; the trajectory's ``reward`` is their sum, which
        the episode scorer (``episode_rewards``) reads.

        Raises:
            KeyError: no completion was recorded for the episode's branch.
        """
        completions = self._branch(episode_id, branch)
        first = completions[0]
        traj = Trajectory(episode_id=episode_id, prompt_ids=list(first.prompt_ids))
        context = list(first.prompt_ids)
        for c in completions:
            # Each request extended the previous one's recorded tokens (checked when it came).
            between = c.prompt_ids[len(context) :]
            if between:
                traj.segments.append(Segment(policy=False, token_ids=between))
            chosen = c.choice
            traj.segments.append(
                Segment(
                    policy=True,
                    token_ids=list(chosen.token_ids),
                    logprobs=list(chosen.logprobs),
                    versions=list(chosen.versions),
                )
            )
            context = [*c.prompt_ids, *chosen.token_ids]
        traj.turn_rewards = [c.reward for c in completions]
        traj.turn_rewards[-1] += reward
        traj.reward = sum(traj.turn_rewards)
        traj.done = done
        return traj

    # -- HTTP ---------------------------------------------------------------------------

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """The API key, then the handler; a refusal as OpenAI's error body."""
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return _error(
                RequestError(
                    "a valid API key is required: send it as a bearer token (Authorization: "
                    "Bearer KEY; the openai client's api_key). In a run the key is "
                    "ctx.api_key, written into RUN_DIR/api_key",
                    code="invalid_api_key",
                    status=401,
                )
            )
        try:
            return await handler(request)
        except RequestError as exc:
            return _error(exc)
        except web.HTTPRequestEntityTooLarge:
            return _error(
                RequestError(
                    f"the request body is over {self.max_body_bytes} bytes, the most this "
                    "endpoint reads (max_body_bytes)",
                    code="request_too_large",
                )
            )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}
        )

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise RequestError(f"the body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise RequestError(
                f"model {model!r} does not exist: this endpoint serves {self.model_name!r}",
                param="model",
                code="model_not_found",
                status=404,
            )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        req = completion_request(await self._body(request))
        self._check_model(req.model)
        episode_id, branch = _episode_of(request, req.user)
        async with self._turn(episode_id, branch) as completions:
            _, ids = self._completion_ids(req, episode_id, completions)
            budget = self._budget(ids, req.max_tokens, "prompt")
            choices = await self._generate(ids, req, budget, episode_id, prefix="", tools=False)
            completion = self._record(
                completions,
                ids,
                choices,
                prompt_text=req.prompt if isinstance(req.prompt, str) else "",
            )
        if req.stream:
            return await self._stream_completions(request, completion, req, len(ids))
        return web.json_response(
            {
                **self._head("text_completion", completion.id),
                "choices": [
                    {
                        "index": i,
                        "text": c.text,
                        "finish_reason": c.finish,
                        "logprobs": self._text_logprobs(c) if req.logprobs else None,
                    }
                    for i, c in enumerate(choices)
                ],
                "usage": _usage(ids, choices),
            }
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        req = chat_request(await self._body(request))
        self._check_model(req.model)
        episode_id, branch = _episode_of(request, req.user)
        tools = req.tools if req.tool_choice != "none" else []
        prefix = ""
        if req.tool_choice == "required":
            prefix = self.chat.call_prefix(None)
        elif isinstance(req.tool_choice, dict):
            prefix = self.chat.call_prefix(req.tool_choice["function"]["name"])
        async with self._turn(episode_id, branch) as completions:
            _, ids = self._chat_ids(req, tools, prefix, episode_id, branch, completions)
            budget = self._budget(ids, req.max_tokens, "messages")
            choices = await self._generate(ids, req, budget, episode_id, prefix, bool(tools))
            if not req.parallel_tool_calls:
                for c in choices:
                    if len(c.message.get("tool_calls", [])) > 1:
                        c.message["tool_calls"] = c.message["tool_calls"][:1]
            completion = self._record(
                completions, ids, choices, messages=req.messages, tools=req.tools
            )
        if req.stream:
            return await self._stream_chat(request, completion, req, len(ids))
        return web.json_response(
            {
                **self._head("chat.completion", completion.id),
                "choices": [
                    {
                        "index": i,
                        "message": _reply(c.message),
                        "finish_reason": c.finish,
                        "logprobs": self._chat_logprobs(c) if req.logprobs else None,
                    }
                    for i, c in enumerate(choices)
                ],
                "usage": _usage(ids, choices),
            }
        )

    # -- episodes and history ----------------------------------------------------------

    @asynccontextmanager
    async def _turn(self, episode_id: str, branch: str) -> AsyncIterator[list[Completion] | None]:
        """The branch's completions while one request of it runs (None outside an episode).

        Raises:
            RequestError: the episode was forgotten, or the branch has a request in flight.
        """
        if not episode_id:
            yield None
            return
        why = self._forgotten.get(episode_id)
        if why is not None:
            raise RequestError(
                f"episode {episode_id!r} {why}; a new conversation needs a new episode id",
                code="episode_closed",
                status=409,
            )
        episode = self.episodes.get(episode_id)
        if episode is None:
            episode = self.episodes[episode_id] = Episode(episode_id, self.clock())
        if branch in episode.busy:
            raise RequestError(
                f"episode {episode_id!r} (branch {branch!r}) already has a request in flight: "
                "two conversations share the episode id, or one sent two requests of one "
                "conversation at once. Give each conversation its own id, and a deliberate "
                f"fork its own branch ({BRANCH_HEADER})",
                code="episode_busy",
                status=409,
            )
        episode.busy.add(branch)
        episode.touched = self.clock()
        completions = episode.branches.setdefault(branch, [])
        try:
            yield completions
        finally:
            episode.busy.discard(branch)
            episode.touched = self.clock()
            if not completions and self.episodes.get(episode_id) is episode:
                del episode.branches[branch]  # refused before anything was recorded
                if not episode.branches:
                    del self.episodes[episode_id]

    def _record(
        self, completions: list[Completion] | None, ids: list[int], choices: list[Choice], **kw: Any
    ) -> Completion:
        completion = Completion(
            id=f"asyncrl-{next(self._ids)}", prompt_ids=ids, choices=choices, **kw
        )
        if completions is not None:
            completions.append(completion)
        return completion

    def _completion_ids(
        self, req: CompletionRequest, episode_id: str, completions: list[Completion] | None
    ) -> tuple[_Base | None, list[int]]:
        """A completion request's context: the branch's recorded tokens and what the prompt
        adds to them.

        Raises:
            RequestError: the prompt does not extend the branch's history (409).
        """
        if not completions:
            if isinstance(req.prompt, list):
                return None, list(req.prompt)
            return None, self.encode(req.prompt)
        last = completions[-1]
        if last.messages is not None:
            raise RequestError(
                f"episode {episode_id!r} is a chat conversation: send its requests to "
                "/v1/chat/completions",
                code="episode_api",
                status=409,
            )
        if isinstance(req.prompt, list):
            for k, c in enumerate(last.choices):
                done = [*last.prompt_ids, *c.token_ids]
                if req.prompt[: len(done)] == done:
                    last.chosen = k
                    return _Base(last, k), list(req.prompt)
            done = [*last.prompt_ids, *last.choices[0].token_ids]
            at = next(
                (i for i, (a, b) in enumerate(zip(done, req.prompt, strict=False)) if a != b),
                min(len(done), len(req.prompt)),
            )
            raise RequestError(
                f"prompt: the token ids differ from episode {episode_id!r}'s recorded history "
                f"at position {at} (recorded {done[at : at + 8]}, got {req.prompt[at : at + 8]}); "
                "a request of an episode must extend its last prompt and completion",
                param="prompt",
                code="history_mismatch",
                status=409,
            )
        for k, c in enumerate(last.choices):
            shown = last.prompt_text + c.text
            if req.prompt.startswith(shown):
                rest = req.prompt[len(shown) :]
                last.chosen = k
                return _Base(last, k), [*last.prompt_ids, *c.token_ids, *self.encode(rest)]
        shown = last.prompt_text + last.choices[0].text
        at = next(
            (i for i, (a, b) in enumerate(zip(shown, req.prompt, strict=False)) if a != b),
            min(len(shown), len(req.prompt)),
        )
        first = completions[0].prompt_text
        reused = at < len(first)
        raise RequestError(
            f"prompt: differs from episode {episode_id!r}'s recorded history at character {at}: "
            f"recorded {shown[at : at + 40]!r}, got {req.prompt[at : at + 40]!r}; "
            + (
                "it does not start as the episode's first prompt did: the episode id is reused "
                "or shared by another conversation; give each its own"
                if reused
                else "a request of an episode must extend its last prompt and completion as the "
                "agent was shown them"
            ),
            param="prompt",
            code="episode_reused" if reused else "history_mismatch",
            status=409,
        )

    def _chat_ids(
        self,
        req: ChatRequest,
        tools: list[dict[str, Any]],
        prefix: str,
        episode_id: str,
        branch: str,
        completions: list[Completion] | None,
    ) -> tuple[_Base | None, list[int]]:
        """A chat request's context: the recorded tokens of the history it extends, then the
        tokens of what it adds, then ``prefix``.

        Raises:
            RequestError: the messages do not extend the branch's history (409), or the chat
                template does not render the conversation as an extension of its history.
        """
        messages = req.messages
        base: _Base | None = None
        if completions:
            last = completions[-1]
            if last.messages is None:
                raise RequestError(
                    f"episode {episode_id!r} is a completions conversation: send its requests "
                    "to /v1/completions",
                    code="episode_api",
                    status=409,
                )
            base = self._extends(req, episode_id, branch, completions)
            base.completion.chosen = base.choice  # the branch goes on with this choice
        elif completions is not None:  # a new branch: the deepest completion it extends
            episode = self.episodes[episode_id]
            for other in episode.branches.values():
                for c in other:
                    found = _extension(c, messages, req.tools)
                    if found is not None and (
                        base is None or len(c.messages or []) > len(base.completion.messages or [])
                    ):
                        base = _Base(c, found)
        if base is None:
            return None, self.encode(self.chat.render(messages, tools, generate=True) + prefix)
        k = len(base.completion.messages or [])
        choice = base.completion.choices[base.choice]
        full = self.chat.render(messages, tools, generate=True)
        closed = self.chat.render(messages[: k + 1], tools, generate=False)
        opened = self.chat.render(messages[:k], tools, generate=True)
        if not full.startswith(closed):
            raise RequestError(
                "messages: the chat template does not render this conversation as an extension "
                "of its history (a template that rewrites earlier turns), so the recorded "
                "tokens cannot be kept; the endpoint needs a template that only appends",
                param="messages",
                code="template_rewrites_history",
            )
        turn = closed[len(opened) :] if closed.startswith(opened) else closed
        end = turn.rfind(self.chat.turn_end)
        closing = turn[end:] if end >= 0 else ""
        if choice.token_ids and choice.token_ids[-1] in self.stop_token_ids:
            stop_text = self.decode(choice.token_ids[-1:])
            if closing.startswith(stop_text):
                closing = closing[len(stop_text) :]
        between = closing + full[len(closed) :] + prefix
        ids = [*base.completion.prompt_ids, *choice.token_ids, *self.encode(between)]
        return base, ids

    def _extends(
        self, req: ChatRequest, episode_id: str, branch: str, completions: list[Completion]
    ) -> _Base:
        """The recorded completion and choice the request's history extends on its branch.

        Raises:
            RequestError: it extends none (409): the first differing message and its text.
        """
        last = completions[-1]
        found = _extension(last, req.messages, req.tools)
        if found is not None:
            return _Base(last, found)
        if req.tools != last.tools:
            raise RequestError(
                f"tools: differ from those of episode {episode_id!r}'s earlier requests (they "
                "are part of its rendered history); send the same tools in every request of a "
                "branch, or start a new branch",
                param="tools",
                code="history_mismatch",
                status=409,
            )
        recorded = [*(last.messages or []), last.choices[0].message]
        given = req.messages
        at = next(
            (i for i, (a, b) in enumerate(zip(recorded, given, strict=False)) if a != b),
            min(len(recorded), len(given)),
        )
        first = len(completions[0].messages or [])
        if at < first:
            raise RequestError(
                f"messages[{at}] differs from the first request of episode {episode_id!r} "
                f"(branch {branch!r}): recorded {_said(recorded, at)}, got {_said(given, at)}. "
                "The episode id is reused or shared by another conversation: give each its "
                "own episode id",
                param="messages",
                code="episode_reused",
                status=409,
            )
        raise RequestError(
            f"messages[{at}] differs from episode {episode_id!r}'s recorded history (branch "
            f"{branch!r}): recorded {_said(recorded, at)}, got {_said(given, at)}. A request "
            "of an episode must repeat its history exactly, the assistant's messages as the "
            f"endpoint returned them; to go another way, start a branch ({BRANCH_HEADER})",
            param="messages",
            code="history_mismatch",
            status=409,
        )

    def _budget(self, ids: list[int], asked: int | None, param: str) -> int:
        """The completion's token budget: ``asked``, or the default, within the context.

        Raises:
            RequestError: the prompt leaves no room, or ``asked`` does not fit.
        """
        room = self.context_length - len(ids)
        if room < 1:
            raise RequestError(
                f"{param}: the prompt is {len(ids)} tokens and the model's context is "
                f"{self.context_length}, which leaves no room for a completion; shorten it",
                param=param,
                code="context_length_exceeded",
            )
        if asked is None:
            return min(self.max_tokens, room)
        if asked > room:
            raise RequestError(
                f"max_tokens: {asked} does not fit: the prompt is {len(ids)} tokens and the "
                f"model's context {self.context_length}, so at most {room} more",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return asked

    # -- generation ---------------------------------------------------------------------

    async def _generate(
        self,
        ids: list[int],
        req: ChatRequest | CompletionRequest,
        budget: int,
        episode_id: str,
        prefix: str,
        tools: bool,
    ) -> list[Choice]:
        params = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_new_tokens=budget,
            stop_token_ids=self.stop_token_ids,
        )
        prompt = Prompt(id=f"{episode_id or 'openai'}/{next(self._ids)}", token_ids=ids)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._sample(prompt, k, params)) for k in range(req.n)]
        except ExceptionGroup as failed:  # the first failure, as a single request would raise
            raise failed.exceptions[0] from None
        chat = isinstance(req, ChatRequest)
        return [self._choice(t.result(), req.stop, prefix, tools, chat) for t in tasks]

    async def _sample(self, prompt: Prompt, index: int, params: SamplingParams) -> Sample:
        request = GenerateRequest(prompt=prompt, sample_index=index, params=params)
        while True:
            sample: Sample
            (sample,) = await self.rollout.call(
                "generate",
                GenerateBatch([request]),
                list[Sample],
                timeout=self.timeout_s,
                key=(prompt.id, index),
            )
            if sample.finished:
                return sample
            request = GenerateRequest(
                prompt=prompt, sample_index=index, params=params, partial=sample
            )

    def _choice(
        self, sample: Sample, stops: list[str], prefix: str, tools: bool, chat: bool
    ) -> Choice:
        """A sample as a choice: cut after a stop string, its text, its message."""
        tokens = list(sample.token_ids)
        logprobs, versions = list(sample.logprobs), list(sample.versions)
        stopped = bool(tokens) and tokens[-1] in self.stop_token_ids
        finish = "stop" if sample.stop_reason == "stop" else "length"
        shown = tokens[:-1] if stopped else tokens
        text = self.decode(shown)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            # The tokens up to the one that completes the stop string: what the policy wrote
            # and the context goes on from; the text before the stop string: what it shows.
            end = len(text[:cut]) + min(len(s) for s in stops if text.find(s) == cut)
            keep = next(t for t in range(1, len(shown) + 1) if len(self.decode(shown[:t])) >= end)
            tokens, logprobs, versions = tokens[:keep], logprobs[:keep], versions[:keep]
            text, finish = text[:cut], "stop"
        message: dict[str, Any] = {}
        if chat:
            content, calls = self.chat.parse(prefix + text) if tools else (text, [])
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = [c.message() for c in calls]
                finish = "tool_calls" if finish == "stop" else finish
                reply["content"] = content or None
            message = normal_message(reply, 0)
        return Choice(
            token_ids=tokens,
            logprobs=logprobs,
            versions=versions,
            text=text,
            message=message,
            finish=finish,
        )

    # -- answers ------------------------------------------------------------------------

    def _shown_tokens(self, c: Choice) -> list[int]:
        tokens = c.token_ids
        return tokens[:-1] if tokens and tokens[-1] in self.stop_token_ids else tokens

    def _chat_logprobs(self, c: Choice) -> dict[str, Any]:
        tokens = self._shown_tokens(c)
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

    def _text_logprobs(self, c: Choice) -> dict[str, Any]:
        tokens = self._shown_tokens(c)
        pieces = [self.decode([t]) for t in tokens]
        offsets = list(itertools.accumulate((len(p) for p in pieces), initial=0))[:-1]
        return {
            "tokens": pieces,
            "token_logprobs": c.logprobs[: len(tokens)],
            "top_logprobs": None,
            "text_offset": offsets,
        }

    def _pieces(self, c: Choice) -> list[str]:
        """The choice's text as it grew token by token (what a stream sends)."""
        out, before = [], ""
        for t in range(1, len(c.token_ids) + 1):
            now = self.decode(c.token_ids[:t])[: len(c.text)]
            if len(now) > len(before) and c.text.startswith(now):
                out.append(now[len(before) :])
                before = now
        if before != c.text:
            out.append(c.text[len(before) :])
        return out

    async def _events(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        return response

    async def _send(self, response: web.StreamResponse, event: dict[str, Any] | str) -> None:
        data = event if isinstance(event, str) else msgspec.json.encode(event).decode()
        await response.write(f"data: {data}\n\n".encode())

    async def _stream_chat(
        self, request: web.Request, completion: Completion, req: ChatRequest, prompt: int
    ) -> web.StreamResponse:
        response = await self._events(request)
        head = self._head("chat.completion.chunk", completion.id)

        def chunk(index: int, delta: dict[str, Any], **more: Any) -> dict[str, Any]:
            return {**head, "choices": [{"index": index, "delta": delta, **more}]}

        for i, c in enumerate(completion.choices):
            await self._send(response, chunk(i, {"role": "assistant", "content": ""}))
            calls = c.message.get("tool_calls", [])
            if calls:
                content = c.message["content"]
                if content:
                    await self._send(response, chunk(i, {"content": content}))
                for j, call in enumerate(calls):
                    await self._send(response, chunk(i, {"tool_calls": [{"index": j, **call}]}))
            else:
                tokens = self._shown_tokens(c)
                for n, piece in enumerate(self._pieces(c)):
                    more = {}
                    if req.logprobs and n < len(tokens):
                        more["logprobs"] = {
                            "content": [
                                {
                                    "token": self.decode([tokens[n]]),
                                    "logprob": c.logprobs[n],
                                    "bytes": list(self.decode([tokens[n]]).encode()),
                                    "top_logprobs": [],
                                }
                            ]
                        }
                    await self._send(response, chunk(i, {"content": piece}, **more))
            await self._send(response, chunk(i, {}, finish_reason=c.finish))
        if req.include_usage:
            usage = _usage([0] * prompt, completion.choices)
            await self._send(response, {**head, "choices": [], "usage": usage})
        await self._send(response, "[DONE]")
        await response.write_eof()
        return response

    async def _stream_completions(
        self, request: web.Request, completion: Completion, req: CompletionRequest, prompt: int
    ) -> web.StreamResponse:
        response = await self._events(request)
        head = self._head("text_completion", completion.id)
        for i, c in enumerate(completion.choices):
            for piece in self._pieces(c):
                choice = {"index": i, "text": piece, "logprobs": None, "finish_reason": None}
                await self._send(response, {**head, "choices": [choice]})
            last = {"index": i, "text": "", "logprobs": None, "finish_reason": c.finish}
            await self._send(response, {**head, "choices": [last]})
        if req.include_usage:
            usage = _usage([0] * prompt, completion.choices)
            await self._send(response, {**head, "choices": [], "usage": usage})
        await self._send(response, "[DONE]")
        await response.write_eof()
        return response

    def _head(self, kind: str, completion_id: str) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
        }


def _episode_of(request: web.Request, user: str) -> tuple[str, str]:
    episode = request.headers.get(EPISODE_HEADER) or user
    branch = request.headers.get(BRANCH_HEADER) or MAIN
    return episode, branch


def _extension(
    completion: Completion, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> int | None:
    """The choice of ``completion`` that ``messages`` extend (its request's messages, then
    that choice's reply, then more), or None."""
    before = completion.messages or []
    k = len(before)
    if len(messages) <= k or messages[:k] != before or tools != completion.tools:
        return None
    for i, c in enumerate(completion.choices):
        if messages[k] == c.message:
            return i
    return None


def _said(messages: list[dict[str, Any]], at: int) -> str:
    """Message ``at`` as an error shows it."""
    if at >= len(messages):
        return "no message"
    m = messages[at]
    shown = m["content"] if set(m) <= {"role", "content"} else msgspec.json.encode(m).decode()
    if len(shown) > 200:
        shown = shown[:197] + "..."
    return f"{m['role']} {shown!r}"


def _reply(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as the API answers it (content null beside tool calls)."""
    out = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
        out["content"] = message["content"] or None
    return out


def _usage(prompt: list[int], choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": completion,
        "total_tokens": len(prompt) + completion,
    }


def _error(exc: RequestError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)
