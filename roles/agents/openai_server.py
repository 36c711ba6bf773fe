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

**Episodes** (``asyncrl.roles.agents.openai_episodes``). A request is tied to an episode by the
``X-Episode-Id`` header or the body's ``user`` field, and to a branch of it by
``X-Episode-Branch`` (``main`` by default). For each branch the server records the exact token
ids, behaviour log-probs and weight versions of every completion, and ``trajectory(episode_id,
branch=...)`` assembles them into the ``Trajectory`` the learner trains. Each request of a
branch must extend the branch's history exactly, and its context is then the recorded tokens of
that history followed by the tokens of what it adds; a request that does not is refused at once
(409) with the first differing message and its text. ``reward`` gives a completion its turn's
reward; ``close(episode_id)`` forgets an episode, and one left idle for ``idle_timeout_s`` is
forgotten too; a request to a forgotten episode is refused (409).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

try:
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "asyncrl.roles.agents.openai_server needs aiohttp: pip install 'asyncrl[agents]'"
    ) from exc

from asyncrl.errors import AsyncrlError
from asyncrl.roles.agents.chat_format import ChatFormat, PlainChat, TemplateChat
from asyncrl.roles.agents.episodes import Trajectory
from asyncrl.roles.agents.openai_answers import Answers, reply, usage
from asyncrl.roles.agents.openai_episodes import (
    BRANCH_HEADER,
    MAIN,
    Choice,
    Completion,
    Episode,
    EpisodeStore,
)
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

__all__ = ["BRANCH_HEADER", "EPISODE_HEADER", "OpenAIServer"]

EPISODE_HEADER = "X-Episode-Id"
"""The header that names a request's episode (else the body's ``user``)."""
LOOPBACK = ("127.0.0.1", "::1", "localhost")


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
        self.max_body_bytes = max_body_bytes
        self.store = EpisodeStore(
            chat=self.chat,
            encode=self.encode,
            decode=self.decode,
            stop_token_ids=self.stop_token_ids,
            idle_timeout_s=idle_timeout_s,
            clock=clock,
        )
        self.answers = Answers(self.decode, self.stop_token_ids)
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

    async def stop(self) -> None:
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
        await self.stop()

    # -- episodes (the store's) ---------------------------------------------------------

    @property
    def episodes(self) -> dict[str, Episode]:
        """The episodes held, by id."""
        return self.store.episodes

    def reward(
        self, episode_id: str, value: float, *, completion: str | None = None, branch: str = MAIN
    ) -> None:
        """``EpisodeStore.reward``: the completion's (by default the latest's) turn reward."""
        self.store.reward(episode_id, value, completion=completion, branch=branch)

    def trajectory(
        self, episode_id: str, reward: float = 0.0, done: bool = True, *, branch: str = MAIN
    ) -> Trajectory:
        """``EpisodeStore.trajectory``: the branch as the trajectory the learner trains."""
        return self.store.trajectory(episode_id, reward, done, branch=branch)

    def close(self, episode_id: str) -> None:
        """``EpisodeStore.close``: forget the episode; a later request naming it gets 409."""
        self.store.close(episode_id)

    def evict_idle(self) -> list[str]:
        """``EpisodeStore.evict_idle`` (the server calls it every few seconds)."""
        return self.store.evict_idle()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(self.store.idle_timeout_s / 4, 30.0))
            self.store.evict_idle()

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
        except web.HTTPException as exc:  # no such route, or not with that method
            if exc.status < 400:
                raise
            return _error(
                RequestError(
                    f"{request.method} {request.path}: {exc.reason}; this endpoint serves POST "
                    "/v1/chat/completions, POST /v1/completions and GET /v1/models",
                    code="not_served",
                    status=exc.status,
                )
            )
        except AsyncrlError as exc:  # the rollout group did not serve the request
            return _error(
                RequestError(
                    f"the rollout group failed this request: {exc}",
                    code="rollout_failed",
                    status=503,
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
        async with self.store.turn(episode_id, branch) as completions:
            ids, replaces = self.store.completion_context(req, episode_id, completions)
            budget = self._budget(ids, req.max_tokens, "prompt")
            choices = await self._generate(ids, req, budget, episode_id, prefix="", tools=False)
            completion = self.store.record(
                completions,
                ids,
                choices,
                replaces=replaces,
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
                        "logprobs": self.answers.text_logprobs(c) if req.logprobs else None,
                    }
                    for i, c in enumerate(choices)
                ],
                "usage": usage(ids, choices),
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
        async with self.store.turn(episode_id, branch) as completions:
            ids, replaces = self.store.chat_context(
                req, tools, prefix, episode_id, branch, completions
            )
            budget = self._budget(ids, req.max_tokens, "messages")
            choices = await self._generate(ids, req, budget, episode_id, prefix, bool(tools))
            if not req.parallel_tool_calls:
                for c in choices:
                    if len(c.message.get("tool_calls", [])) > 1:
                        c.message["tool_calls"] = c.message["tool_calls"][:1]
            completion = self.store.record(
                completions,
                ids,
                choices,
                replaces=replaces,
                messages=req.messages,
                tools=req.tools,
            )
        if req.stream:
            return await self._stream_chat(request, completion, req, len(ids))
        return web.json_response(
            {
                **self._head("chat.completion", completion.id),
                "choices": [
                    {
                        "index": i,
                        "message": reply(c.message),
                        "finish_reason": c.finish,
                        "logprobs": self.answers.chat_logprobs(c) if req.logprobs else None,
                    }
                    for i, c in enumerate(choices)
                ],
                "usage": usage(ids, choices),
            }
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
                opened = c.message["content"][: len(c.message["content"]) - len(c.text)]
                if opened:  # the text a required tool call opened with, which did not parse
                    await self._send(response, chunk(i, {"content": opened}))
                each = self.answers.chat_logprobs(c)["content"]
                for n, piece in enumerate(self.answers.pieces(c)):
                    if req.logprobs:
                        more = {"logprobs": {"content": each[n : n + 1]}}
                        await self._send(response, chunk(i, {"content": piece}, **more))
                    elif piece:
                        await self._send(response, chunk(i, {"content": piece}))
            await self._send(response, chunk(i, {}, finish_reason=c.finish))
        if req.include_usage:
            counts = usage([0] * prompt, completion.choices)
            await self._send(response, {**head, "choices": [], "usage": counts})
        await self._send(response, "[DONE]")
        await response.write_eof()
        return response

    async def _stream_completions(
        self, request: web.Request, completion: Completion, req: CompletionRequest, prompt: int
    ) -> web.StreamResponse:
        response = await self._events(request)
        head = self._head("text_completion", completion.id)
        for i, c in enumerate(completion.choices):
            for piece in filter(None, self.answers.pieces(c)):
                choice = {"index": i, "text": piece, "logprobs": None, "finish_reason": None}
                await self._send(response, {**head, "choices": [choice]})
            last = {"index": i, "text": "", "logprobs": None, "finish_reason": c.finish}
            await self._send(response, {**head, "choices": [last]})
        if req.include_usage:
            counts = usage([0] * prompt, completion.choices)
            await self._send(response, {**head, "choices": [], "usage": counts})
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


def _error(exc: RequestError) -> web.Response:
    """The refusal as OpenAI's error body. A refusal of the request itself (4xx) says it must
    not be retried (``x-should-retry: false``, which the ``openai`` client obeys): sending it
    again gets the same answer, and the client would otherwise retry a 409 twice."""
    headers = {"x-should-retry": "false"} if exc.status < 500 else {}
    return web.json_response(exc.body(), status=exc.status, headers=headers)
