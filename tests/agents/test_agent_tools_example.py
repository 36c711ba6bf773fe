"""The tool-calling example (examples/agent_tools) in-process: its agent, a tool loop on the
official ``openai`` client, plays calculator episodes through the endpoint (real HTTP) in front
of a scripted policy; a demonstration is the trajectory the endpoint records, the policy's call
and answer trained and the tool's result masked; an episode the environment fails comes back
flagged with its cause and is played again under a fresh id."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from asyncrl.roles.agents.environment_client import EnvironmentClient
from asyncrl.roles.payloads import GenerateBatch, Prompt, Sample
from asyncrl.transport import run
from tests.agents.test_environment_client import Group

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
OpenAIServer = pytest.importorskip("asyncrl.roles.agents.openai_server").OpenAIServer

from examples.agent_tools import program  # noqa: E402  (needs aiohttp and openai)
from examples.agent_tools.agent import CalculatorAgent  # noqa: E402
from examples.agent_tools.calculator import Calculator  # noqa: E402


@pytest.fixture(scope="module")
def tok() -> Any:
    return transformers.AutoTokenizer.from_pretrained("examples/agent_tools/tokenizer")


def test_a_demonstration_is_the_trajectory_the_endpoint_records(tok: Any) -> None:
    cfg = {**program.DEFAULTS, "demos": 8}
    demos = run(program.demonstrations(tok, cfg))
    texts = [tok.decode(d.token_ids) for d in demos]
    called = [t for t in texts if t.startswith("<tool_call>")]
    assert 0 < len(called) < 8  # some call the tool, some guess
    (x, y), demo = next(
        (task, d)
        for task, d, t in zip(program.calculator.tasks(8, 0), demos, texts, strict=True)
        if t.startswith("<tool_call>")
    )
    assert tok.decode(demo.token_ids) == (
        f'<tool_call> {{"name": "add", "arguments": {{"x": {x}, "y": {y} }}}} </tool_call> '
        f"<|im_end|> <|im_start|> user <tool_response> = {x + y} </tool_response> <|im_end|> "
        f"<|im_start|> assistant {x + y} <|im_end|>"
    )
    # The call and the answer (each with its end of turn) are the policy's; the result is not.
    assert demo.loss_mask == [1] * 12 + [0] * 9 + [1] * 2
    assert demo.turn_rewards == [0.0, 1.0]
    assert tok.decode(demo.prompt_ids).endswith(f"user {x} + {y} <|im_end|> <|im_start|> assistant")


def test_the_agent_plays_through_the_endpoint_and_a_failing_replica_is_never_trained(
    tok: Any,
) -> None:
    group = Group(2, failing=1, env_class=Calculator)

    async def main() -> tuple[list[Any], Counter[str], dict[str, Any]]:
        policy = program.ScriptedPolicy(tok, tool_share=1.0, seed=0)  # always calls the tool
        env = EnvironmentClient(group, step_timeout_s=0.2, quarantine_window=100)
        async with OpenAIServer(policy, tokenizer=tok, context_length=96) as server:
            client = openai.AsyncOpenAI(base_url=server.url, api_key=server.api_key)
            agent = CalculatorAgent(server, client, env)
            metrics: Counter[str] = Counter()
            prompt = Prompt(id="sum-0", token_ids=[7], answer="17 25")
            samples = [await agent.source(prompt, k, metrics) for k in range(3)]
            again = await agent.source(prompt, 1, metrics)  # the pipeline's fresh episode
            await client.close()
            return [*samples, again], metrics, dict(server.episodes)

    samples, metrics, held = run(main())
    first, failed, third, again = samples
    # Round robin: sample 0 on env.0, 1 on env.1 (its step hangs past the deadline), 2 on
    # env.0 again; the replacement of sample 1 avoids env.1, which failed it, and plays on env.0.
    assert (first.infra_failed, first.turn_rewards) == ("", [0.0, 1.0])
    assert (failed.infra_failed, failed.token_ids) == ("timeout", [])
    assert third.infra_failed == "" and third.token_ids == first.token_ids
    assert (again.infra_failed, again.prompt_id, again.sample_index) == ("", "sum-0", 1)
    assert group.reset_ids == ["sum-0/0", "sum-0/1", "sum-0/2", "sum-0/1~1"]
    assert group.resets == [0, 1, 0, 0]
    assert metrics["episodes"] == 4 and metrics["env_timeouts"] == 1
    assert metrics["env_errors"] == 0 and metrics["tool_calls"] == 3
    assert held == {}  # every conversation closed on the endpoint


def test_a_replica_failing_every_step_is_quarantined_while_the_others_carry_on(tok: Any) -> None:
    async def main() -> tuple[list[str], Counter[str]]:
        policy = program.ScriptedPolicy(tok, tool_share=1.0, seed=0)
        group = Group(3, failing=0, env_class=Calculator)
        env = EnvironmentClient(group, step_timeout_s=0.2, quarantine_window=2)
        async with OpenAIServer(policy, tokenizer=tok, context_length=96) as server:
            client = openai.AsyncOpenAI(base_url=server.url, api_key=server.api_key)
            agent = CalculatorAgent(server, client, env)
            metrics: Counter[str] = Counter()
            prompt = Prompt(id="p", token_ids=[7], answer="1 2")
            causes = [(await agent.source(prompt, k, metrics)).infra_failed for k in range(12)]
            await client.close()
            return causes, metrics

    causes, metrics = run(main())
    # env.0 fails the two episodes it gets (0 and 3), then takes none: the rest all play.
    assert causes == ["timeout", "", "", "error"] + [""] * 8
    assert metrics["quarantined"] == 1 and metrics["quarantine_released"] == 0


class AlwaysCalls:
    """A policy that calls ``add 1 2`` at every turn and never answers."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        assert method == "generate" and isinstance(payload, GenerateBatch)
        (request,) = payload.requests
        text = '<tool_call> {"name": "add", "arguments": {"x": 1, "y": 2}} </tool_call>'
        tokens = [*self.tok.encode(text, add_special_tokens=False), self.tok.eos_token_id]
        return [
            Sample(
                prompt_id=request.prompt.id,
                sample_index=0,
                prompt_ids=request.prompt.token_ids,
                token_ids=tokens,
                logprobs=[0.0] * len(tokens),
                versions=[0] * len(tokens),
                finished=True,
                stop_reason="stop",
            )
        ]


def test_an_episode_whose_calls_fill_the_context_ends_with_reward_0_and_is_trained(
    tok: Any,
) -> None:
    """The question is 14 tokens and each call with its result 21 more: the third request (56
    tokens) leaves no room for 12 more in a context of 60, and the endpoint refuses it
    (``context_length_exceeded``). That is the policy's doing, as running out of turns is."""

    async def main() -> tuple[Any, Counter[str]]:
        env = EnvironmentClient(Group(1, env_class=Calculator), step_timeout_s=5.0)
        async with OpenAIServer(AlwaysCalls(tok), tokenizer=tok, context_length=60) as server:
            client = openai.AsyncOpenAI(base_url=server.url, api_key=server.api_key)
            agent = CalculatorAgent(server, client, env)
            metrics: Counter[str] = Counter()
            sample = await agent.source(Prompt(id="p", token_ids=[7], answer="1 2"), 0, metrics)
            await client.close()
            return sample, metrics

    sample, metrics = run(main())
    assert (sample.infra_failed, sample.turn_rewards) == ("", [0.0, 0.0])
    # Both calls are trained, the first one's result masked; the second's result reached only
    # the refused request.
    assert sample.loss_mask == [1] * 12 + [0] * 9 + [1] * 12
    assert metrics["tool_calls"] == 2 and metrics["episodes"] == 1
