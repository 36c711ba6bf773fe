"""The episodes the OpenAI-compatible endpoint records, exact to the token, and the check that
each request extends its episode's history.

``EpisodeStore`` is the endpoint's logic without HTTP (``asyncrl.roles.agents.openai_server``
wraps it): for each episode and branch it keeps every completion (``Completion``: the context's
token ids, each choice's token ids, behaviour log-probs and versions, what the agent was shown);
``chat_context``/``completion_context`` give a request's context, the recorded tokens of the
history it extends followed by the tokens of what it adds, or refuse it (``RequestError``, 409)
naming what differs; ``trajectory`` assembles a branch into the ``Trajectory`` the learner
trains; a request that repeats the branch's last one replaces its completion (a retry
whose answer was lost, or a fresh sample of the same turn); ``reward`` gives a completion its
turn's reward; ``close`` and ``evict_idle`` forget
episodes, and a forgotten id is refused rather than started again.

The history is compared as messages (as ``normal_message`` has them) or as the text the agent
was shown, never as re-tokenized text; only what a request adds is tokenized. For a chat
request, what stands between the recorded completion and the new messages is found by rendering
the conversation with and without the new messages: the rest of the assistant's turn after the
policy's own text (the template's ``turn_end`` and what follows it; the stop token the policy
sampled is not repeated) and the new turns.
"""

from __future__ import annotations

import collections
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec

from asyncrl.roles.agents.chat_format import ChatFormat
from asyncrl.roles.agents.episodes import Segment, Trajectory
from asyncrl.roles.agents.openai_requests import ChatRequest, CompletionRequest, RequestError

__all__ = [
    "BRANCH_HEADER",
    "MAIN",
    "Choice",
    "Completion",
    "Episode",
    "EpisodeStore",
]

BRANCH_HEADER = "X-Episode-Branch"
"""The header that names a request's branch of its episode."""
MAIN = "main"
"""The branch of a request without the header."""
FORGOTTEN_KEPT = 100_000
"""How many forgotten episode ids the store remembers, to refuse their reuse."""


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


class EpisodeStore:
    """The episodes of an endpoint (see the module).

    Args:
        chat: how the endpoint renders chat messages.
        encode: text -> token ids; decode: token ids -> text.
        stop_token_ids: the tokens that end every completion.
        idle_timeout_s: an episode without a request for this long is forgotten by
            ``evict_idle``.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        *,
        chat: ChatFormat,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        stop_token_ids: list[int],
        idle_timeout_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.chat = chat
        self.encode = encode
        self.decode = decode
        self.stop_token_ids = stop_token_ids
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.episodes: dict[str, Episode] = {}
        self._forgotten: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._ids = itertools.count()

    def close(self, episode_id: str) -> None:
        """Forget the episode; a later request naming it is refused (409).

        Raises:
            KeyError: the server holds no such episode.
        """
        del self.episodes[episode_id]
        self._forget(episode_id, "was closed")

    def evict_idle(self) -> list[str]:
        """Forget every episode without a request for ``idle_timeout_s`` and none in flight
        (the endpoint calls this every few seconds); the ids forgotten."""
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

    @asynccontextmanager
    async def turn(self, episode_id: str, branch: str) -> AsyncIterator[list[Completion] | None]:
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

    def record(
        self,
        completions: list[Completion] | None,
        ids: list[int],
        choices: list[Choice],
        *,
        replaces: bool = False,
        **kw: Any,
    ) -> Completion:
        """Add a request's completion to its branch (``completions``; None outside an episode),
        in place of the branch's last one when the request repeated it (``replaces``)."""
        completion = Completion(
            id=f"asyncrl-{next(self._ids)}", prompt_ids=ids, choices=choices, **kw
        )
        if completions is not None:
            if replaces:
                completions.pop()
            completions.append(completion)
        return completion

    def completion_context(
        self, req: CompletionRequest, episode_id: str, completions: list[Completion] | None
    ) -> tuple[list[int], bool]:
        """A completion request's context: the branch's recorded tokens and what the prompt
        adds to them; and whether the request repeats the branch's last one (its completion is
        then replaced: a retry whose answer was lost, or a fresh sample of the same turn).

        Raises:
            RequestError: the prompt does not extend the branch's history (409).
        """
        if completions and completions[-1].messages is None:
            last = completions[-1]
            same = last.prompt_ids if isinstance(req.prompt, list) else last.prompt_text
            if req.prompt == same:
                return self._completion_ids(req, episode_id, completions[:-1]), True
        return self._completion_ids(req, episode_id, completions), False

    def _completion_ids(
        self, req: CompletionRequest, episode_id: str, completions: list[Completion] | None
    ) -> list[int]:
        if not completions:
            if isinstance(req.prompt, list):
                return list(req.prompt)
            return self.encode(req.prompt)
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
                    return list(req.prompt)
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
                return [*last.prompt_ids, *c.token_ids, *self.encode(rest)]
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

    def chat_context(
        self,
        req: ChatRequest,
        tools: list[dict[str, Any]],
        prefix: str,
        episode_id: str,
        branch: str,
        completions: list[Completion] | None,
    ) -> tuple[list[int], bool]:
        """A chat request's context: the recorded tokens of the history it extends, then the
        tokens of what it adds, then ``prefix``; and whether the request repeats the branch's
        last one (its messages and tools: its completion is then replaced, a retry whose answer
        was lost, or a fresh sample of the same turn).

        Raises:
            RequestError: the messages do not extend the branch's history (409), or the chat
                template does not render the conversation as an extension of its history.
        """
        if completions:
            last = completions[-1]
            if last.messages == req.messages and last.tools == req.tools:
                earlier = completions[:-1]
                return self._chat_ids(req, tools, prefix, episode_id, branch, earlier), True
        return self._chat_ids(req, tools, prefix, episode_id, branch, completions), False

    def _chat_ids(
        self,
        req: ChatRequest,
        tools: list[dict[str, Any]],
        prefix: str,
        episode_id: str,
        branch: str,
        completions: list[Completion] | None,
    ) -> list[int]:
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
            return self.encode(self.chat.render(messages, tools, generate=True) + prefix)
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
        return ids

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
