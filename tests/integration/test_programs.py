"""The built-in control-flow programs run end to end on the arithmetic task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

MANIFEST = """\
run:
  name: builtin
  program: asyncrl.roles.program.programs:{program}
  config: {{steps: {steps}, prompts_per_step: 8, group_size: 4, max_new_tokens: 5,
           stop_token_ids: [1], batch: 32, lr: 0.003}}
model:  # every role below inherits the model, or its tokenizer, from here
  config: {{model_type: gpt2, vocab_size: 14, n_positions: 16, n_embd: 32, n_layer: 1,
           n_head: 2, eos_token_id: 1, pad_token_id: 0}}
  tokenizer: examples/arith/tokenizer
roles:
  prompts:
    class: asyncrl.roles.services.prompts:PromptSource
    config: {{generator: "examples.arith.data:rl_prompts"}}
  rollout:
    class: asyncrl.roles.generation.rollout:Rollout
    config: {{weights_from: learner}}
  reward:
    class: asyncrl.roles.services.reward:Reward
    config: {{verifier: exact}}
  learner:
    class: asyncrl.roles.training.learner:Learner
  {extra}
{pipeline}
"""


def run_program(  # type: ignore[type-arg]
    run_dir: str,
    program: str,
    steps: int,
    extra: str = "",
    pipeline: str = "",
    overrides: tuple[str, ...] = (),
) -> dict:
    path = os.path.join(run_dir, "m.yaml")
    text = MANIFEST.format(program=program, steps=steps, extra=extra, pipeline=pipeline)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    args = ["--run-dir", run_dir, "--allow-nonempty", *(a for o in overrides for a in ("--set", o))]
    return _run(args, path, run_dir)


def resume_program(run_dir: str, steps: int) -> dict:  # type: ignore[type-arg]
    """Continue the run in ``run_dir`` with ``--resume``, its saved manifest asking for
    ``steps`` steps in all (editing the saved manifest is how a resumed run changes)."""
    saved = os.path.join(run_dir, "manifest.json")
    with open(saved) as f:
        manifest = json.load(f)
    manifest["run"]["config"]["steps"] = steps
    with open(saved, "w") as f:
        json.dump(manifest, f)
    return _run(["--resume", run_dir], None, run_dir)


def _run(args: list[str], path: str | None, run_dir: str) -> dict:  # type: ignore[type-arg]
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", *([path] if path else []), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(os.path.join(run_dir, "driver.json")) as f:
        result: dict = json.load(f)["result"]  # type: ignore[type-arg]
    return result


def test_bc_lowers_the_loss(run_dir: str) -> None:
    """The built-in ``bc`` runs on a ``Run``, as ``grpo`` does: each step's ``nll`` in the
    run's history, the ledger ids minted by ``Run.bc_step``, the summary and the export."""
    result = run_program(run_dir, "bc", 40)
    assert result["steps"] == 40 and result["cursor"] == 40 * 32
    first, last = result["nll"][:5], result["nll"][-5:]
    assert sum(last) < 0.6 * sum(first)
    assert result["learner_steps"] == 40
    assert result["final"] == os.path.join(run_dir, "exports", "final")
    assert os.path.exists(os.path.join(run_dir, "exports", "final", "config.json"))
    with open(os.path.join(run_dir, "history.jsonl")) as f:
        history = [json.loads(line) for line in f]
    assert [(e["phase"], e["step"]) for e in history] == [("bc", s) for s in range(1, 41)]
    assert [e["nll"] for e in history] == result["nll"]
    with open(os.path.join(run_dir, "ledger", "learner.0.steps.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    # Each use of a demonstration has an id of its own: "<prompt id>#bc<step>".
    assert {pid.rpartition("#")[2] for pid, _ in steps[2]["ids"]} == {"bc2"}
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["learner_steps"] == 40


def test_grpo_runs_and_evaluates_the_heldout_prompts(run_dir: str) -> None:
    path = os.path.join(run_dir, "heldout.jsonl")
    with open(path, "w") as f:  # 24 additions in the arith example's form: "07+45=" -> "052"
        for a, b in zip(range(3, 99, 4), range(90, 18, -3), strict=True):
            f.write(json.dumps({"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"}) + "\n")
    source = "asyncrl.roles.services.prompts:PromptSource"
    role = f"heldout: {{class: '{source}', config: {{path: {path}}}}}"
    result = run_program(run_dir, "grpo", 4, role, overrides=("run.config.eval_every=3",))
    assert len(result["rewards"]) == 4 and result["cursor"] == 32
    # Every 3 steps and after the last, greedy accuracy over all 24 held-out prompts.
    assert [h["step"] for h in result["heldout"]] == [3, 4]
    for h in result["heldout"]:
        assert 0.0 <= h["accuracy"] <= 1.0 and (h["accuracy"] * 24) == round(h["accuracy"] * 24)
    with open(os.path.join(run_dir, "logs", "driver.0.jsonl")) as f:
        logged = [json.loads(line)["event"] for line in f]
    assert (
        sum(
            "held-out accuracy" in event and "(24 prompts, greedy, versions [" in event
            for event in logged
        )
        == 2
    )
    assert result["pipeline"]["consumed_samples"] == 4 * 32
    # Written on a Run: the history, the summary and the exported policy are the run's.
    assert result["accuracy_final"] == result["heldout"][-1]["accuracy"]
    assert (result["learner_steps"], result["samples_consumed"]) == (4, 4 * 32)
    with open(os.path.join(run_dir, "history.jsonl")) as f:
        history = [json.loads(line) for line in f]
    assert [(h["phase"], h["step"]) for h in history] == [("rl", s) for s in (1, 2, 3, 4)]
    assert [h["step"] for h in history if "accuracy" in h] == [3, 4]
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["accuracy_final"] == result["accuracy_final"]
    assert os.path.isfile(os.path.join(result["final"], "config.json"))
    # Sync: one batch in flight. A fifth may be admitted after the fourth step, as the program
    # ends, and is then cancelled.
    assert 4 * 32 <= result["pipeline"]["admitted_samples"] <= 5 * 32


def test_grpo_runs_in_async_mode(run_dir: str) -> None:
    pipeline = "pipeline: {mode: async, eta: 1, over_eta: drop}"
    result = run_program(run_dir, "grpo", 4, pipeline=pipeline)
    metrics = result["pipeline"]
    assert len(result["rewards"]) == 4
    # Admission ran ahead of the learner, but never beyond eta + 1 batches of its version.
    assert metrics["consumed_samples"] == 4 * 32
    wasted = metrics.get("wasted_samples", 0)
    assert 4 * 32 < metrics["admitted_samples"] <= (4 + 1 + 1) * 32 + wasted
    assert result["cursor"] >= 4 * 8


def test_ppo_runs_with_a_critic(run_dir: str) -> None:
    critic = "critic: {class: 'asyncrl.roles.training.critic:Critic'}"
    result = run_program(run_dir, "ppo", 3, critic)
    assert len(result["rewards"]) == 3
    assert "heldout" not in result  # no heldout role: no evaluation


@pytest.mark.timeout(600)  # two runs, each past a minute on a loaded machine
def test_a_resumed_async_run_paces_from_the_checkpointed_version(run_dir: str) -> None:
    pipeline = "pipeline: {mode: async, eta: 1}"
    keep = ("roles.learner.config.checkpoint_every=2",)
    first = run_program(run_dir, "grpo", 4, pipeline=pipeline, overrides=keep)
    assert len(first["rewards"]) == 4
    second = resume_program(run_dir, 6)
    # It resumed at step 4 and took two more steps ...
    assert len(second["rewards"]) == 2
    # The pipeline's counters go on from the resumed step: 4 batches before, 2 after.
    assert second["pipeline"]["consumed_samples"] == 6 * 32
    # ... admitting at most eta + 1 batches past the resumed version (4), then one per step:
    # a pacer counting from version 0 would have let (4 + 2) batches more in at once. The
    # resumed counters start with the 4 batches consumed before.
    assert second["pipeline"]["admitted_samples"] - 4 * 32 <= (2 + 1 + 1) * 32
    assert second["cursor"] >= first["cursor"] - 32


def test_grpo_stops_on_a_target_at_an_evaluation_boundary(run_dir: str) -> None:
    """A reward target of 0 is reached at the first step; with evaluations every 3 steps the
    stop lands on step 3, the first boundary, which evaluates."""
    path = os.path.join(run_dir, "heldout.jsonl")
    with open(path, "w") as f:
        for a in range(10):
            f.write(json.dumps({"prompt": f"{a:02d}+{a:02d}=", "answer": f"{2 * a:03d}"}) + "\n")
    source = "asyncrl.roles.services.prompts:PromptSource"
    role = f"heldout: {{class: '{source}', config: {{path: {path}}}}}"
    overrides = ("run.config.eval_every=3", "run.config.stop_at={reward: 0.0}")
    result = run_program(run_dir, "grpo", 10, role, overrides=overrides)
    assert result["steps"] == 3 and len(result["rewards"]) == 3
    assert result["stop_reason"].startswith("the reward ") and not result["stopped_by_budget"]
    assert [h["step"] for h in result["heldout"]] == [3]


PROGRAM_READS_ITS_CONFIG = """
from asyncrl.roles.services.reward import Reward


async def main(ctx):
    reward = ctx.role_config("reward")
    assert isinstance(reward, Reward.Config)
    return {"tokenizer": ctx.model.tokenizer, "reward": [reward.verifier, reward.tokenizer_path]}
"""


def test_a_program_reads_the_model_section_and_role_configs_typed(run_dir: str) -> None:
    with open(os.path.join(run_dir, "flow.py"), "w") as f:
        f.write(PROGRAM_READS_ITS_CONFIG)
    path = os.path.join(run_dir, "m.yaml")
    text = MANIFEST.format(program="x", steps=1, extra="", pipeline="")
    text = text.replace("asyncrl.roles.program.programs:x", f"{run_dir}/flow.py:main")
    with open(path, "w") as f:
        f.write(text)
    result = _run(["--run-dir", run_dir, "--allow-nonempty"], path, run_dir)
    tokenizer = "examples/arith/tokenizer"
    assert result == {"tokenizer": tokenizer, "reward": ["exact", tokenizer]}
