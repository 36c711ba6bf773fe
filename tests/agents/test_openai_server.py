"""The OpenAI-compatible endpoint (asyncrl.roles.agents.openai_server), driven by the official
``openai`` client over HTTP: agent code written against it runs unchanged, and the episode's
trajectory holds exactly the tokens the policy generated."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import Any

import aiohttp
import msgspec
import pytest

from asyncrl.errors import DeadlineExceededError
from asyncrl.roles.agents.episodes import episode_rewards
from asyncrl.roles.payloads import GenerateBatch, Sample
from asyncrl.supervision.agent import install_secret
from asyncrl.transport import run
from asyncrl.transport.control import SECRET_FILE_ENV, api_key, run_api_key
from tests.agents.test_episodes import decode, encode
from tests.conftest import ROOT

openai = pytest.importorskip("openai")
OpenAIServer = pytest.importorskip("asyncrl.roles.agents.openai_server").OpenAIServer

logging.getLogger("httpx").setLevel(logging.WARNING)  # the client logs every request at info

EOS = 3  # the digit 3 doubles as end-of-sequence here: replies never contain it


class Replies:
    """A rollout that answers ``ok<n>`` (n counting calls) then EOS, version 5."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.budgets: list[int] = []  # each request's max_new_tokens

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        (request,) = payload.requests if isinstance(payload, GenerateBatch) else ()
        self.prompts.append(list(request.prompt.token_ids))
        self.budgets.append(request.params.max_new_tokens)
        tokens = [*encode(f"ok{len(self.prompts)}"), EOS]
        return [
            Sample(
                prompt_id=request.prompt.id,
                sample_index=0,
                prompt_ids=request.prompt.token_ids,
                token_ids=tokens,
                logprobs=[-0.5] * len(tokens),
                versions=[5] * len(tokens),
                finished=True,
                stop_reason="stop",
            )
        ]


def server(rollout: Replies, **kw: Any) -> OpenAIServer:
    options = {"context_length": 512, "max_tokens": 64, **kw}
    return OpenAIServer(rollout, encode=encode, decode=decode, stop_token_ids=[EOS], **options)


def client_of(srv: OpenAIServer, **kw: Any) -> Any:
    return openai.AsyncOpenAI(base_url=srv.url, api_key=srv.api_key, max_retries=0, **kw)


def test_a_chat_agent_runs_unchanged_and_its_trajectory_is_what_the_policy_generated() -> None:
    async def main() -> None:
        rollout = Replies()
        async with server(rollout) as srv:
            client = client_of(srv)
            messages: list[dict[str, str]] = [{"role": "system", "content": "be brief"}]
            for turn in ("hi", "more"):
                messages.append({"role": "user", "content": turn})
                reply = await client.chat.completions.create(
                    model="policy",
                    messages=messages,
                    user="ep-1",  # type: ignore[arg-type]
                )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            models = await client.models.list()
            await client.close()
        assert [m["content"] for m in messages if m["role"] == "assistant"] == ["ok1", "ok2"]
        assert [m.id for m in models.data] == ["policy"]
        traj = srv.trajectory("ep-1", reward=1.0)
        policy = [s for s in traj.segments if s.policy]
        assert [s.token_ids for s in policy] == [[*encode("ok1"), EOS], [*encode("ok2"), EOS]]
        assert all(s.versions == [5] * 4 and s.logprobs == [-0.5] * 4 for s in policy)
        # The second prompt holds the first reply's own tokens (its EOS too), not a re-render.
        first_prompt, second_prompt = rollout.prompts
        assert second_prompt[: len(first_prompt) + 4] == first_prompt + encode("ok1") + [EOS]
        between = [s for s in traj.segments if not s.policy]
        assert [decode(s.token_ids) for s in between] == ["\nuser: more\nassistant: "]
        assert traj.prompt_ids == first_prompt
        assert traj.loss_mask.count(1) == 8 and len(traj.loss_mask) == len(traj.token_ids)

    run(main())


def test_completions_take_text_or_token_ids_and_bad_requests_get_a_400() -> None:
    async def main() -> None:
        rollout = Replies()
        async with server(rollout) as srv:
            client = client_of(srv)
            one = await client.completions.create(model="policy", prompt="2+2=", user="ep")
            again = await client.completions.create(
                model="policy", prompt="2+2=" + one.choices[0].text + "\x0c" + "more", user="ep"
            )
            ids = await client.completions.create(model="policy", prompt=[1, 2], max_tokens=4)
            await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=7
            )
            await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "hi"}],
                max_completion_tokens=9,
            )
            with pytest.raises(openai.BadRequestError, match="messages"):
                await client.chat.completions.create(model="policy", messages=[])
            await client.close()
        assert (one.choices[0].text, one.choices[0].finish_reason) == ("ok1", "stop")
        assert again.choices[0].text == "ok2" and ids.choices[0].text == "ok3"
        assert one.usage is not None and one.usage.completion_tokens == 4
        # The default budget, then max_tokens, then the chat API's newer max_completion_tokens.
        assert rollout.budgets == [64, 64, 4, 7, 9]
        # The agent appended to what it got: the first completion's tokens are reused as such.
        assert rollout.prompts[1][: len(rollout.prompts[0]) + 4] == (
            rollout.prompts[0] + encode("ok1") + [EOS]
        )
        traj = srv.trajectory("ep")
        assert [s.policy for s in traj.segments] == [True, False, True]
        assert "ep" in srv.episodes and len(srv.episodes) == 1  # the untagged call is not kept

    run(main())


def test_the_agents_per_turn_rewards_and_the_final_reward_reach_the_scorer() -> None:
    async def main() -> None:
        async with server(Replies()) as srv:
            client = client_of(srv)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
            first = await client.chat.completions.create(
                model="policy", messages=messages, user="ep"
            )
            srv.reward("ep", 0.25)  # the latest completion: the first
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "again"},
            ]
            await client.chat.completions.create(model="policy", messages=messages, user="ep")
            srv.reward("ep", 0.5, completion=first.id)  # added to the first's 0.25
            with pytest.raises(KeyError, match="episode 'ep' has no completion 'nope'"):
                srv.reward("ep", 1.0, completion="nope")
            with pytest.raises(ValueError, match="expected a finite number, got nan"):
                srv.reward("ep", float("nan"))
            await client.close()
        traj = srv.trajectory("ep", reward=1.0)  # the final reward: the last turn's
        assert traj.turn_rewards == [0.75, 1.0] and traj.reward == 1.75
        sample = traj.sample("p", 0)
        assert sample.turn_rewards == [0.75, 1.0]
        assert await episode_rewards([sample]) == [1.75]
        discounted = functools.partial(episode_rewards, gamma=0.5)
        assert await discounted([sample]) == [1.25]  # 0.75 + 1.0 * 0.5

    run(main())


def test_a_trajectory_from_the_endpoint_scores_its_reward() -> None:
    async def main() -> None:
        async with server(Replies()) as srv:
            client = client_of(srv)
            await client.completions.create(model="policy", prompt="2+2=", user="ep")
            await client.close()
        return srv.trajectory("ep", reward=1.0).sample("p", 0)

    sample = run(main())
    assert sample.turn_rewards == [1.0]
    assert asyncio.run(episode_rewards([sample])) == [1.0]


def test_a_request_without_the_key_gets_a_401() -> None:
    async def main() -> None:
        rollout = Replies()
        async with server(rollout, api_key="k-123") as srv:
            assert srv.api_key == "k-123"
            for key in ("wrong", "k-1234"):
                bad = openai.AsyncOpenAI(base_url=srv.url, api_key=key, max_retries=0)
                with pytest.raises(openai.AuthenticationError) as err:
                    await bad.chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": "hi"}]
                    )
                assert err.value.status_code == 401
                assert err.value.body["code"] == "invalid_api_key"  # type: ignore[index]
                assert err.value.body["message"].startswith(  # type: ignore[index]
                    "a valid API key is required: send it as a bearer token"
                )
                with pytest.raises(openai.AuthenticationError):
                    await bad.models.list()
                await bad.close()
            async with aiohttp.ClientSession() as http:  # no Authorization header at all
                async with http.post(f"{srv.url}/completions", json={}) as response:
                    assert response.status == 401
            good = client_of(srv)
            assert [m.id for m in (await good.models.list()).data] == ["policy"]
            await good.close()
        assert rollout.prompts == []  # nothing reached the rollout

    run(main())


def test_the_run_writes_its_api_key_beside_its_secret_and_the_program_reads_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    secret_file = install_secret(str(tmp_path), "s" * 32)
    key_file = tmp_path / "api_key"
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    key = key_file.read_text()
    assert key == api_key("s" * 32) and len(key) == 40 and key != "s" * 32
    assert os.environ[SECRET_FILE_ENV] == secret_file
    assert run_api_key() == key
    srv = server(Replies())
    assert srv.api_key == key  # in a run, the server requires the run's key by default
    monkeypatch.delenv(SECRET_FILE_ENV)
    assert run_api_key() is None
    outside = server(Replies())
    assert len(outside.api_key) == 40 and outside.api_key != key  # a fresh one


def test_listening_beyond_loopback_is_an_explicit_option() -> None:
    async def main() -> None:
        srv = server(Replies())
        with pytest.raises(ValueError) as err:
            await srv.start(host="0.0.0.0")
        assert str(err.value) == (
            "host '0.0.0.0' is not a loopback address: pass remote=True to listen there "
            "(requests still need the API key, sent in clear over HTTP)"
        )
        url = await srv.start(host="0.0.0.0", remote=True)
        assert url.startswith("http://0.0.0.0:")
        await srv.stop()

    run(main())


async def _refused(srv: OpenAIServer, body: dict[str, Any], path: str = "chat/completions") -> Any:
    """The error body of a request the endpoint must refuse with a 400, sent raw."""
    headers = {"Authorization": f"Bearer {srv.api_key}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(f"{srv.url}/{path}", data=body_text(body)) as response:
            assert response.status == 400, await response.text()
            return (await response.json())["error"]


def body_text(body: dict[str, Any]) -> str:
    """JSON as a client may send it: NaN and huge numbers included."""
    import json

    return json.dumps(body)


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"max_tokens": -5}, "max_tokens", "max_tokens: expected an integer >= 1, got -5"),
        ({"max_tokens": "abc"}, "max_tokens", "max_tokens: expected an integer >= 1, got 'abc'"),
        ({"max_tokens": 1e30}, "max_tokens", "max_tokens: expected an integer >= 1, got 1e+30"),
        (
            {"temperature": float("nan")},
            "temperature",
            "temperature: expected a number in [0.0, 2.0], got nan",
        ),
        ({"top_p": 0}, "top_p", "top_p: expected a number in (0.0, 1.0], got 0"),
        ({"n": 0}, "n", "n: expected an integer from 1 to 16, got 0"),
        (
            {"max_completion_tokens": 4, "max_tokens": 5},
            "max_completion_tokens",
            "max_tokens (5) and max_completion_tokens (4) differ; send one",
        ),
    ],
)
def test_a_bad_number_is_a_400_that_names_it(
    fields: dict[str, Any], param: str, message: str
) -> None:
    async def main() -> None:
        rollout = Replies()
        async with server(rollout) as srv:
            error = await _refused(srv, {"model": "policy", "messages": HI, **fields})
        assert (error["message"], error["param"]) == (message, param)
        assert rollout.prompts == []

    run(main())


def test_max_tokens_is_bounded_by_the_models_context() -> None:
    async def main() -> None:
        rollout = Replies()
        async with server(rollout, context_length=20) as srv:
            client = client_of(srv)
            with pytest.raises(openai.BadRequestError) as err:  # 14 + 7 > 20
                await client.completions.create(model="policy", prompt="x" * 14, max_tokens=7)
            assert err.value.body["message"] == (  # type: ignore[index]
                "max_tokens: 7 does not fit: the prompt is 14 tokens and the model's context "
                "20, so at most 6 more"
            )
            with pytest.raises(openai.BadRequestError) as err:
                await client.completions.create(model="policy", prompt="x" * 20)
            assert err.value.body["message"] == (  # type: ignore[index]
                "prompt: the prompt is 20 tokens and the model's context is 20, which leaves no "
                "room for a completion; shorten it"
            )
            assert err.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
            error = await _refused(
                srv, {"model": "policy", "prompt": "x", "max_tokens": 10**30}, "completions"
            )
            assert error["message"].startswith(f"max_tokens: {10**30} does not fit")
            # Without max_tokens: the default (64), cut to what the context leaves.
            await client.completions.create(model="policy", prompt="x" * 14)
            await client.close()
        assert rollout.budgets == [6]

    run(main())


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"frobnicate": 1},
            "frobnicate",
            "frobnicate: the chat completions endpoint does not support this field; leave it out",
        ),
        ({"seed": 3}, "seed", "seed: the rollout group samples with its own generators"),
        (
            {"presence_penalty": 0.5},
            "presence_penalty",
            "presence_penalty: only 0 is supported, got 0.5",
        ),
        (
            {"logprobs": True, "top_logprobs": 2},
            "top_logprobs",
            "top_logprobs: the rollout returns the log-prob of the sampled token only",
        ),
        (
            {"response_format": {"type": "json_object"}},
            "response_format",
            "response_format: only {'type': 'text'} is supported",
        ),
        (
            {"messages": [*HI, {"role": "assistant", "content": "x", "reasoning_content": "r"}]},
            "messages",
            "messages[1].reasoning_content: not supported (send null or leave it out)",
        ),
        (
            {"messages": [{"role": "tool", "content": "5"}]},
            "messages",
            "messages[0].tool_call_id: a tool message needs the id of the call it answers, "
            "got None",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "messages[0].content[0]: only text parts ({type: 'text', text}) are supported, "
            "got 'image_url'",
        ),
    ],
)
def test_an_unsupported_field_is_refused_by_name(
    fields: dict[str, Any], param: str, message: str
) -> None:
    async def main() -> None:
        async with server(Replies()) as srv:
            error = await _refused(srv, {"model": "policy", "messages": HI, **fields})
        assert error["message"].startswith(message) and error["param"] == param

    run(main())


def test_an_oversized_body_and_an_unknown_model_are_refused() -> None:
    async def main() -> None:
        async with server(Replies(), max_body_bytes=1000) as srv:
            error = await _refused(srv, {"model": "policy", "messages": HI, "user": "u" * 2000})
            assert error["message"] == (
                "the request body is over 1000 bytes, the most this endpoint reads (max_body_bytes)"
            )
            client = client_of(srv)
            with pytest.raises(openai.NotFoundError, match="model 'gpt-4' does not exist"):
                await client.chat.completions.create(model="gpt-4", messages=HI)
            await client.close()

    run(main())


def test_a_rewritten_history_is_refused_at_once_with_the_first_differing_message() -> None:
    async def main() -> None:
        rollout = Replies()
        async with server(rollout) as srv:
            client = client_of(srv)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
            first = await client.chat.completions.create(
                model="policy", messages=messages, user="ep"
            )
            rewritten = [
                *messages,
                {"role": "assistant", "content": first.choices[0].message.content + "\n"},
                {"role": "user", "content": "more"},
            ]
            with pytest.raises(openai.ConflictError) as err:
                await client.chat.completions.create(model="policy", messages=rewritten, user="ep")
            assert err.value.status_code == 409
            assert err.value.body["code"] == "history_mismatch"  # type: ignore[index]
            assert err.value.body["message"] == (  # type: ignore[index]
                "messages[1] differs from episode 'ep''s recorded history (branch 'main'): "
                "recorded assistant 'ok1', got assistant 'ok1\\n'. A request of an episode must "
                "repeat its history exactly, the assistant's messages as the endpoint returned "
                "them; to go another way, start a branch (X-Episode-Branch)"
            )
            # The completions API: a prompt that does not extend the last one and its text.
            await client.completions.create(model="policy", prompt="2+2=", user="text")
            with pytest.raises(openai.ConflictError) as err:
                await client.completions.create(model="policy", prompt="2+2= ok2", user="text")
            assert err.value.body["message"] == (  # type: ignore[index]
                "prompt: differs from episode 'text''s recorded history at character 4: "
                "recorded 'ok2', got ' ok2'; a request of an episode must extend its last "
                "prompt and completion as the agent was shown them"
            )
            await client.close()
        assert len(rollout.prompts) == 2  # the refused requests never reached the rollout
        assert srv.trajectory("ep").turns == 1

    run(main())


def test_an_episode_id_reused_by_another_conversation_is_its_own_error() -> None:
    async def main() -> None:
        async with server(Replies()) as srv:
            client = client_of(srv)
            await client.chat.completions.create(model="policy", messages=HI, user="ep")
            other = [{"role": "user", "content": "what is 2+2"}]
            with pytest.raises(openai.ConflictError) as err:
                await client.chat.completions.create(model="policy", messages=other, user="ep")
            assert err.value.body["code"] == "episode_reused"  # type: ignore[index]
            assert err.value.body["message"] == (  # type: ignore[index]
                "messages[0] differs from the first request of episode 'ep' (branch 'main'): "
                "recorded user 'hi', got user 'what is 2+2'. The episode id is reused or shared "
                "by another conversation: give each its own episode id"
            )
            await client.close()

    run(main())


class Held(Replies):
    """A rollout whose first call waits until released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        if not self.entered.is_set():
            self.entered.set()
            await self.release.wait()
        return await super().call(method, payload, reply_type, **kw)


def test_two_requests_in_flight_on_one_episode_are_refused_as_a_shared_id() -> None:
    async def main() -> None:
        rollout = Held()
        async with server(rollout) as srv:
            client = client_of(srv)
            first = asyncio.create_task(
                client.chat.completions.create(model="policy", messages=HI, user="ep")
            )
            await rollout.entered.wait()
            with pytest.raises(openai.ConflictError) as err:
                await client.chat.completions.create(model="policy", messages=HI, user="ep")
            assert err.value.body["code"] == "episode_busy"  # type: ignore[index]
            assert err.value.body["message"].startswith(  # type: ignore[index]
                "episode 'ep' (branch 'main') already has a request in flight"
            )
            rollout.release.set()
            assert (await first).choices[0].message.content == "ok1"
            await client.close()

    run(main())


def test_a_branch_header_starts_a_branch_that_is_its_own_trajectory() -> None:
    async def main() -> None:
        rollout = Replies()
        async with server(rollout) as srv:
            client = client_of(srv)
            first = await client.chat.completions.create(model="policy", messages=HI, user="ep")
            history = [*HI, {"role": "assistant", "content": first.choices[0].message.content}]
            await client.chat.completions.create(
                model="policy", messages=[*history, {"role": "user", "content": "a"}], user="ep"
            )
            # Another way on from the first reply, deliberately: a branch of its own.
            await client.chat.completions.create(
                model="policy",
                messages=[*history, {"role": "user", "content": "b"}],
                user="ep",
                extra_headers={"X-Episode-Branch": "b"},
            )
            await client.close()
        main_branch = srv.trajectory("ep")
        branch = srv.trajectory("ep", branch="b")
        assert [decode(s.token_ids) for s in main_branch.segments if s.policy] == [
            "ok13",
            "ok23",
        ]
        # The branch's prompt holds the first reply's own tokens, masked out; its one
        # completion is its own.
        assert decode(branch.prompt_ids) == "user: hi\nassistant: ok13\nuser: b\nassistant: "
        assert branch.prompt_ids == rollout.prompts[2]
        assert [decode(s.token_ids) for s in branch.segments] == ["ok33"]

    run(main())


def test_close_and_an_idle_timeout_forget_an_episode() -> None:
    async def main() -> None:
        now = [0.0]
        async with server(Replies(), idle_timeout_s=60, clock=lambda: now[0]) as srv:
            client = client_of(srv)
            for episode in ("a", "b"):
                await client.chat.completions.create(model="policy", messages=HI, user=episode)
            srv.close("a")
            now[0] = 59.0
            assert srv.evict_idle() == []
            now[0] = 60.0
            assert srv.evict_idle() == ["b"]
            assert srv.episodes == {}
            for episode, why in (("a", "was closed"), ("b", "was idle for 60 s and forgotten")):
                with pytest.raises(openai.ConflictError) as err:
                    await client.chat.completions.create(model="policy", messages=HI, user=episode)
                assert err.value.body["message"] == (  # type: ignore[index]
                    f"episode {episode!r} {why}; a new conversation needs a new episode id"
                )
            with pytest.raises(KeyError, match="episode 'a' was closed"):
                srv.trajectory("a")
            await client.close()

    run(main())


class Says(Replies):
    """A rollout that answers ``text`` then EOS, every time."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        (sample,) = await super().call(method, payload, reply_type, **kw)
        tokens = [*encode(self.text), EOS]
        return [
            msgspec.structs.replace(
                sample, token_ids=tokens, logprobs=[-0.25] * len(tokens), versions=[2] * len(tokens)
            )
        ]


def test_n_returns_n_choices_and_the_next_request_chooses_which_one_trains() -> None:
    async def main() -> None:
        rollout = Replies()
        async with server(rollout) as srv:
            client = client_of(srv)
            reply = await client.chat.completions.create(
                model="policy", messages=HI, n=3, user="ep"
            )
            texts = [c.message.content for c in reply.choices]
            assert texts == ["ok1", "ok2", "ok3"] and [c.index for c in reply.choices] == [0, 1, 2]
            assert reply.usage is not None and reply.usage.completion_tokens == 12
            await client.chat.completions.create(
                model="policy",
                messages=[
                    *HI,
                    {"role": "assistant", "content": "ok2"},
                    {"role": "user", "content": "go"},
                ],
                user="ep",
            )
            await client.close()
        traj = srv.trajectory("ep")
        assert [decode(s.token_ids) for s in traj.segments if s.policy] == ["ok23", "ok43"]
        assert rollout.prompts[3][: len(rollout.prompts[0]) + 4] == rollout.prompts[0] + encode(
            "ok2"
        ) + [EOS]

    run(main())


def test_stop_ends_the_text_at_the_stop_string_and_the_context_keeps_what_was_generated() -> None:
    async def main() -> None:
        rollout = Says("ab,cd")
        async with server(rollout) as srv:
            client = client_of(srv)
            reply = await client.chat.completions.create(
                model="policy", messages=HI, stop=[",", "zz"], user="ep"
            )
            assert reply.choices[0].message.content == "ab"
            assert reply.choices[0].finish_reason == "stop"
            await client.chat.completions.create(
                model="policy",
                messages=[
                    *HI,
                    {"role": "assistant", "content": "ab"},
                    {"role": "user", "content": "x"},
                ],
                user="ep",
            )
            text = await client.completions.create(model="policy", prompt="q", stop="c")
            assert text.choices[0].text == "ab,"
            await client.close()
        traj = srv.trajectory("ep")
        assert [decode(s.token_ids) for s in traj.segments] == [
            "ab,",
            "\nuser: x\nassistant: ",
            "ab,cd3",
        ]
        assert traj.segments[0].logprobs == [-0.25] * 3

    run(main())


def test_logprobs_are_the_sampled_tokens_behaviour_log_probs() -> None:
    async def main() -> None:
        async with server(Says("hey")) as srv:
            client = client_of(srv)
            chat = await client.chat.completions.create(model="policy", messages=HI, logprobs=True)
            text = await client.completions.create(model="policy", prompt="q", logprobs=0)
            await client.close()
        content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
        assert [(t.token, t.logprob, t.top_logprobs) for t in content] == [
            ("h", -0.25, []),
            ("e", -0.25, []),
            ("y", -0.25, []),
        ]
        logprobs = text.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens == ["h", "e", "y"]
        assert logprobs.token_logprobs == [-0.25] * 3 and logprobs.text_offset == [0, 1, 2]

    run(main())


def test_stream_sends_server_sent_events_the_client_reads() -> None:
    async def main() -> None:
        async with server(Says("hey")) as srv:
            client = client_of(srv)
            stream = await client.chat.completions.create(
                model="policy",
                messages=HI,
                stream=True,
                stream_options={"include_usage": True},
                user="ep",
            )
            chunks = [chunk async for chunk in stream]
            text = await client.completions.create(model="policy", prompt="q", stream=True)
            pieces = [chunk async for chunk in text]
            scored = await client.chat.completions.create(
                model="policy", messages=HI, stream=True, logprobs=True
            )
            with_logprobs = [chunk async for chunk in scored]
            await client.close()
        deltas = [c.choices[0].delta.content for c in chunks if c.choices]
        assert deltas == ["", "h", "e", "y", None]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        assert "".join(p.choices[0].text for p in pieces) == "hey"
        assert pieces[-1].choices[0].finish_reason == "stop"
        tokens = [
            (t.token, t.logprob)
            for c in with_logprobs
            if c.choices[0].logprobs is not None
            for t in c.choices[0].logprobs.content or []
        ]
        assert tokens == [("h", -0.25), ("e", -0.25), ("y", -0.25)]
        assert decode(srv.trajectory("ep").segments[0].token_ids) == "hey3"

    run(main())


def test_content_as_text_parts_and_max_completion_tokens() -> None:
    async def main() -> None:
        rollout = Replies()
        async with server(rollout) as srv:
            client = client_of(srv)
            parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
            await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": parts}],  # type: ignore[list-item]
                max_completion_tokens=9,
            )
            await client.close()
        assert decode(rollout.prompts[0]) == "user: hi\nassistant: "
        assert rollout.budgets == [9]

    run(main())


class Script:
    """A rollout that answers each call with the next of ``texts`` (tokenized) then EOS."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.prompts: list[list[int]] = []

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        (request,) = payload.requests
        self.prompts.append(list(request.prompt.token_ids))
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False)
        tokens = [*ids, self.tokenizer.eos_token_id]
        return [
            Sample(
                prompt_id=request.prompt.id,
                sample_index=0,
                prompt_ids=request.prompt.token_ids,
                token_ids=tokens,
                logprobs=[-0.5] * len(tokens),
                versions=[1] * len(tokens),
                finished=True,
                stop_reason="stop",
            )
        ]


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "add two numbers",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    },
}
FAMILIES = {
    # tokenizer, the call as the family writes it, the tool's answer as it stands between turns
    "qwen": (
        "examples/qwen/tokenizer",
        '<tool_call>\n{"name": "add", "arguments": {"x": 2, "y": 3}}\n</tool_call>',
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    "llama3": (
        "examples/qwen/llama3_tokenizer",
        '{"name": "add", "parameters": {"x": 2, "y": 3}}',
        "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_tool_call_round_trip_in_the_familys_own_format(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    path, call, between = FAMILIES[family]
    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(ROOT, path))

    async def main() -> None:
        rollout = Script(tok, [call, "= 5"])
        async with OpenAIServer(rollout, tokenizer=tok, context_length=4096) as srv:
            assert srv.chat.family == family
            client = client_of(srv)
            messages: list[Any] = [{"role": "user", "content": "add 2 3"}]
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[ADD], user="ep"
            )
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (tool_call,) = choice.message.tool_calls or []
            assert tool_call.function.name == "add"  # type: ignore[union-attr]
            assert tool_call.function.arguments == '{"x":2,"y":3}'  # type: ignore[union-attr]
            messages += [
                choice.message,  # as agents do: the client's own message object
                {"role": "tool", "tool_call_id": tool_call.id, "content": "5"},
            ]
            final = await client.chat.completions.create(
                model="policy", messages=messages, tools=[ADD], user="ep"
            )
            assert final.choices[0].message.content == "= 5"
            assert final.choices[0].message.tool_calls is None
            await client.close()
        # The first prompt is the template's rendering with the tools in the family's format.
        first = tok.decode(rollout.prompts[0])
        assert first == srv.chat.render(
            [{"role": "user", "content": "add 2 3"}], [ADD], generate=True
        )
        assert ('"name": "add"' in first) and ("add two numbers" in first)
        traj = srv.trajectory("ep", reward=1.0)
        assert [tok.decode(s.token_ids) for s in traj.segments] == [
            call + tok.eos_token,
            between,
            "= 5" + tok.eos_token,
        ]
        assert traj.loss_mask.count(1) == len(traj.segments[0].token_ids) + len(
            traj.segments[2].token_ids
        )

    run(main())


def test_tool_choice_required_opens_the_call_for_the_policy() -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(ROOT, "examples/qwen/tokenizer"))

    async def main() -> None:
        rollout = Script(tok, ['{"name": "add", "arguments": {"x": 1}}\n</tool_call>', "{}"])
        async with OpenAIServer(rollout, tokenizer=tok, context_length=4096) as srv:
            client = client_of(srv)
            reply = await client.chat.completions.create(
                model="policy", messages=HI, tools=[ADD], tool_choice="required"
            )
            (call,) = reply.choices[0].message.tool_calls or []
            assert (call.function.name, call.function.arguments) == ("add", '{"x":1}')  # type: ignore[union-attr]
            none = await client.chat.completions.create(
                model="policy", messages=HI, tools=[ADD], tool_choice="none"
            )
            assert none.choices[0].message.content == "{}"
            await client.close()
        assert tok.decode(rollout.prompts[0]).endswith("<|im_start|>assistant\n<tool_call>\n")
        assert "<tools>" not in tok.decode(rollout.prompts[1])  # none: no tools offered

    run(main())


def test_episodes_played_through_the_endpoint_reach_the_learners_batch_with_their_rewards() -> None:
    """The sample pipeline runs an agent through the endpoint as its sample source; the batch
    it hands the learner holds each episode's discounted return and its group advantage."""
    from asyncrl.manifest.pipeline_section import PipelineSpec
    from asyncrl.roles.payloads import Prompt, SamplingParams
    from asyncrl.roles.sampling.pipeline import BatchSettings, SamplePipeline

    async def feed(cursor: int, n: int) -> list[Any]:
        return [
            Prompt(id=f"p{i}", token_ids=encode(f"q{i}"), text=f"q{i}")
            for i in range(cursor, min(cursor + n, 2))
        ]

    async def main() -> Any:
        async with server(Replies()) as srv:
            client = client_of(srv)

            async def agent(prompt: Prompt, index: int, metrics: Any) -> Sample:
                episode = f"{prompt.id}/{index}"
                messages: list[Any] = [{"role": "user", "content": prompt.text}]
                first = await client.chat.completions.create(
                    model="policy", messages=messages, user=episode
                )
                srv.reward(episode, 0.5)  # the first turn's reward
                messages += [
                    {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "more"},
                ]
                await client.chat.completions.create(
                    model="policy", messages=messages, user=episode
                )
                traj = srv.trajectory(episode, reward=float(index))  # the final reward
                srv.close(episode)
                return traj.sample(prompt.id, index)

            pipe = SamplePipeline(
                srv.rollout,
                spec=PipelineSpec(mode="async", eta=1),
                feed=feed,
                score=functools.partial(episode_rewards, gamma=0.5),
                params=SamplingParams(max_new_tokens=4),
                settings=BatchSettings(batch_size=4, group_size=2, drop_uniform=False),
                source=agent,
            )
            async with pipe:
                batch = await asyncio.wait_for(pipe.next_batch(), 30)
            await client.close()
            return batch, srv.episodes

    batch, left = run(main())
    got = sorted(
        (s.sample.prompt_id, s.sample.sample_index, s.sample.turn_rewards, s.reward, s.advantage)
        for s in batch.samples
    )
    # Index i's turns: [0.5, i]; discounted at 0.5: 0.5 + 0.5 * i. Each group holds 0.5 and
    # 1.0 (mean 0.75, population std 0.25): advantages -1 and +1.
    assert [g[:4] for g in got] == [
        ("p0", 0, [0.5, 0.0], 0.5),
        ("p0", 1, [0.5, 1.0], 1.0),
        ("p1", 0, [0.5, 0.0], 0.5),
        ("p1", 1, [0.5, 1.0], 1.0),
    ]
    assert [g[4] for g in got] == pytest.approx([-1.0, 1.0, -1.0, 1.0], abs=1e-4)
    assert all(s.sample.loss_mask.count(1) == 8 for s in batch.samples)  # two replies of 4
    assert left == {}  # every episode closed


def test_a_named_tool_choice_opens_that_functions_call_in_llama3s_format() -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(
        os.path.join(ROOT, "examples/qwen/llama3_tokenizer")
    )

    async def main() -> None:
        rollout = Script(tok, ['{"x": 4}}'])
        async with OpenAIServer(rollout, tokenizer=tok, context_length=4096) as srv:
            client = client_of(srv)
            reply = await client.chat.completions.create(
                model="policy",
                messages=HI,
                tools=[ADD],
                tool_choice={"type": "function", "function": {"name": "add"}},
            )
            await client.close()
        (call,) = reply.choices[0].message.tool_calls or []
        assert (call.function.name, call.function.arguments) == ("add", '{"x":4}')  # type: ignore[union-attr]
        assert tok.decode(rollout.prompts[0]).endswith(
            '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "add", "parameters": '
        )

    run(main())


def test_parallel_tool_calls_false_keeps_the_first_call_of_a_reply() -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(ROOT, "examples/qwen/tokenizer"))
    two = (
        '<tool_call>\n{"name": "add", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"x": 2}}\n</tool_call>'
    )

    async def main() -> None:
        rollout = Script(tok, [two, two])
        async with OpenAIServer(rollout, tokenizer=tok, context_length=4096) as srv:
            client = client_of(srv)
            both = await client.chat.completions.create(model="policy", messages=HI, tools=[ADD])
            one = await client.chat.completions.create(
                model="policy", messages=HI, tools=[ADD], parallel_tool_calls=False
            )
            await client.close()
        assert [c.function.arguments for c in both.choices[0].message.tool_calls or []] == [  # type: ignore[union-attr]
            '{"x":1}',
            '{"x":2}',
        ]
        assert [c.function.arguments for c in one.choices[0].message.tool_calls or []] == [  # type: ignore[union-attr]
            '{"x":1}'
        ]

    run(main())


class Failing(Replies):
    """A rollout group whose calls fail as a dead replica's do."""

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        await super().call(method, payload, reply_type, **kw)
        raise DeadlineExceededError("ipc://rollout-0", "generate", 600.0, pid=41)


def test_refusals_are_not_retried_and_a_failing_rollout_is_a_503() -> None:
    async def main() -> None:
        rollout = Failing()
        async with server(rollout) as srv:
            headers = {"Authorization": f"Bearer {srv.api_key}"}
            async with aiohttp.ClientSession(headers=headers) as http:
                body = {"model": "policy", "messages": HI, "max_tokens": -5}
                async with http.post(f"{srv.url}/chat/completions", json=body) as response:
                    assert response.status == 400
                    assert response.headers["x-should-retry"] == "false"
            client = client_of(srv)
            with pytest.raises(openai.InternalServerError) as err:
                await client.chat.completions.create(model="policy", messages=HI)
            assert err.value.status_code == 503
            assert err.value.body["message"] == (  # type: ignore[index]
                "the rollout group failed this request: request 'generate' to ipc://rollout-0 "
                "got no answer within its deadline of 600.000 s; the peer (pid 41) is slow, "
                "hung or gone. Raise the timeout if the work is legitimately long."
            )
            await client.close()

    run(main())


def test_the_default_client_does_not_retry_a_refused_history() -> None:
    httpx = pytest.importorskip("httpx")

    async def main() -> int:
        sent: list[str] = []

        async def count(request: Any) -> None:
            sent.append(str(request.url))

        async with server(Replies()) as srv:
            http = httpx.AsyncClient(event_hooks={"request": [count]})
            client = openai.AsyncOpenAI(
                base_url=srv.url, api_key=srv.api_key, max_retries=2, http_client=http
            )
            await client.chat.completions.create(model="policy", messages=HI, user="ep")
            other = [{"role": "user", "content": "bye"}]
            with pytest.raises(openai.ConflictError):
                await client.chat.completions.create(model="policy", messages=other, user="ep")
            await client.close()
        return len(sent)

    assert run(main()) == 2  # one each: the 409 was not sent again


def test_a_repeated_last_request_replaces_its_completion() -> None:
    """A retry whose answer was lost (or a fresh sample of the same turn) sends the branch's
    last request again: its new completion takes the old one's place in the trajectory."""

    async def main() -> None:
        rollout = Replies()
        async with server(rollout) as srv:
            client = client_of(srv)
            first = await client.chat.completions.create(model="policy", messages=HI, user="ep")
            history = [*HI, {"role": "assistant", "content": first.choices[0].message.content}]
            asked = [*history, {"role": "user", "content": "more"}]
            await client.chat.completions.create(model="policy", messages=asked, user="ep")
            srv.reward("ep", 0.5)  # given to the completion about to be replaced
            again = await client.chat.completions.create(model="policy", messages=asked, user="ep")
            assert again.choices[0].message.content == "ok3"
            with pytest.raises(openai.ConflictError):  # an earlier request is no repeat
                await client.chat.completions.create(model="policy", messages=HI, user="ep")
            await client.completions.create(model="policy", prompt="2+2=", user="text")
            await client.completions.create(model="policy", prompt="2+2=", user="text")
            await client.close()
        traj = srv.trajectory("ep")
        assert [decode(s.token_ids) for s in traj.segments if s.policy] == ["ok13", "ok33"]
        assert traj.turn_rewards == [0.0, 0.0]
        assert rollout.prompts[2] == rollout.prompts[1]  # the same context, sampled again
        text = srv.trajectory("text")
        assert [decode(s.token_ids) for s in text.segments] == ["ok53"]

    run(main())


def test_a_path_the_endpoint_does_not_serve_is_answered_in_openais_error_format() -> None:
    async def main() -> None:
        async with server(Replies()) as srv:
            client = client_of(srv)
            with pytest.raises(openai.NotFoundError) as err:
                await client.embeddings.create(model="policy", input="hi")
            await client.close()
        assert err.value.body["message"] == (  # type: ignore[index]
            "POST /v1/embeddings: Not Found; this endpoint serves POST /v1/chat/completions, "
            "POST /v1/completions and GET /v1/models"
        )

    run(main())
