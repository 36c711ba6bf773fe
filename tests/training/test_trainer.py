"""The trainer in-process, through its public methods alone: a micro-batched step of an
objective, a step that does not depend on the micro-batch cut, log-probs, its state saved and
loaded, and a sharded group's state loaded at another world size."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

from asyncrl.plugins.registry import current as current_plugin
from asyncrl.roles.payloads import Sample, Scored
from asyncrl.roles.training.models import build_model
from asyncrl.roles.training.sharding import ShardingError
from asyncrl.roles.training.trainer import Trainer, TrainerSettings
from tests.training.test_data_parallel import run_ranks

MODEL = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 16,
    "n_embd": 16,
    "n_layer": 2,
    "n_head": 2,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def make(**settings: Any) -> Trainer:
    options: dict[str, Any] = {"seed": 0, "lr": 0.01, "dtype": "float64", **settings}
    return Trainer(
        TrainerSettings(**options),
        lambda: build_model("", MODEL, 0),
        plugin=current_plugin(),
        device=torch.device("cpu"),
    )


def demos() -> list[Scored]:
    def sample(i: int, prompt: list[int], tokens: list[int]) -> Scored:
        return Scored(
            sample=Sample(
                prompt_id=f"d{i}",
                sample_index=0,
                prompt_ids=prompt,
                token_ids=tokens,
                logprobs=[0.0] * len(tokens),
                versions=[0] * len(tokens),
                finished=True,
                stop_reason="stop",
            )
        )

    return [
        sample(0, [2, 12, 3], [4, 5, 1]),
        sample(1, [3], [6, 1]),
        sample(2, [2, 13, 3, 13], [7, 8, 9, 1]),
        sample(3, [5, 12], [10, 1]),
    ]


def nll_step(trainer: Trainer, batch: list[Scored]) -> dict[str, float]:
    """One optimizer step of the token-mean NLL of ``batch`` (an objective in its simplest
    form: the loss of each micro-batch over its own tokens, weighed by the trainer)."""

    def loss(chunk: list[int], weight: float) -> tuple[torch.Tensor, dict[str, float]]:
        forward = trainer.forward([batch[i].sample for i in chunk])
        value = -(forward.logprobs * forward.target).sum() / forward.target.sum()
        return value, {"nll": float(value.detach()) * weight}

    return trainer.optimizer_step(batch, loss)


def nll(trainer: Trainer, batch: list[Scored]) -> float:
    return -sum(sum(row) for row in trainer.logprobs([s.sample for s in batch]))


def test_steps_of_an_objective_lower_it() -> None:
    trainer = make()
    batch = demos()
    before = nll(trainer, batch)
    metrics = [nll_step(trainer, batch) for _ in range(5)]
    assert nll(trainer, batch) < before * 0.8
    assert sorted(metrics[0]) == ["grad_norm", "nll"]  # no schedule: no lr
    # The first step's summed metric is the whole batch's token-mean NLL.
    assert metrics[0]["nll"] == pytest.approx(before / 11, rel=1e-9)  # 3 + 2 + 4 + 2 tokens


def test_a_step_does_not_depend_on_the_micro_batch_cut() -> None:
    whole, split = make(), make(micro_batch_tokens=6)
    batch = demos()
    a, b = nll_step(whole, batch), nll_step(split, batch)
    assert a["nll"] == pytest.approx(b["nll"], rel=1e-12)
    for x, y in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


def test_a_schedule_scales_the_peak_and_a_new_peak_applies_at_once() -> None:
    trainer = Trainer(
        TrainerSettings(seed=0, lr=0.1, dtype="float64"),
        lambda: build_model("", MODEL, 0),
        plugin=current_plugin(),
        device=torch.device("cpu"),
        schedule=lambda step: 1.0 / (step + 1),
    )
    assert nll_step(trainer, demos())["lr"] == 0.1
    assert nll_step(trainer, demos())["lr"] == 0.05
    trainer.set_peak_lr(0.3)  # two steps taken: factor 1/3
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1, rel=1e-12)
    assert nll_step(trainer, demos())["lr"] == pytest.approx(0.1, rel=1e-12)  # the step's rate
    assert trainer.optimizer_steps == 3
    assert nll_step(trainer, demos())["lr"] == pytest.approx(0.3 / 4, rel=1e-12)


def test_state_saved_and_loaded_takes_the_same_next_step() -> None:
    trainer = make()
    nll_step(trainer, demos())
    state = copy.deepcopy(trainer.state())  # a checkpoint copies it; the step moves it
    saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    nll_step(trainer, demos())
    after = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    other = make(seed=1)
    other.load_state(state)
    for k, v in other.model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    nll_step(other, demos())  # AdamW's moments came back too: the same step
    for k, v in other.model.state_dict().items():
        assert torch.equal(v, after[k]), k


RANK_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from asyncrl.plugins.registry import current
from asyncrl.roles.training.data_parallel import DataParallel
from asyncrl.roles.training.sharding import full_buckets
from tests.training.test_trainer import MODEL, demos, nll_step
from asyncrl.roles.training.models import build_model
from asyncrl.roles.training.trainer import Trainer, TrainerSettings

rank, run_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
plugin = current()
trainer = Trainer(TrainerSettings(seed=0, lr=0.01, dtype="float64", sharded=True),
                  lambda: build_model("", MODEL, 0), plugin=plugin, device=torch.device("cpu"))
dp = DataParallel.join(name="trainer", rank=rank, world=2, run_dir=run_dir, generation=0,
                       timeout_s=120, comm=plugin.comm)
trainer.join(dp)
for _ in range(2):
    nll_step(trainer, demos())
torch.save(trainer.state(), f"{out}/state{rank}.pt")
whole = {k: v.clone() for bucket in full_buckets(trainer.model, 2**20) for k, v in bucket.items()}
nll_step(trainer, demos())
after = {k: v.clone() for bucket in full_buckets(trainer.model, 2**20) for k, v in bucket.items()}
if rank == 0:
    torch.save({"whole": whole, "after": after}, f"{out}/whole.pt")
with open(f"{out}/rank{rank}.json", "w") as f:
    f.write("{}")
dp.close()
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sharded_groups_state_loads_on_one_rank(tmp_path: Any) -> None:
    """Two sharded ranks (gloo, FSDP2) save their shards; one unsharded trainer loads both
    (``load_states``), holds the group's whole weights and AdamW state, and takes the step the
    group took next."""
    out = str(tmp_path)
    run_ranks(RANK_SCRIPT, [str(tmp_path / "run"), out], os.path.join(out, "rank{rank}.json"))
    states = [torch.load(f"{out}/state{r}.pt", weights_only=False) for r in range(2)]
    expected = torch.load(f"{out}/whole.pt", weights_only=True)
    assert [s["world"] for s in states] == [2, 2]
    one = make(seed=1)
    with pytest.raises(ShardingError) as error:
        one.load_state(states[0])
    assert str(error.value) == (
        "this sharded checkpoint was written by 2 ranks, and this model is whole; load every "
        "rank's state of that group with load_states"
    )
    with pytest.raises(ShardingError) as error:
        one.load_states(states[:1])
    assert str(error.value) == (
        "expected one whole state or every rank's shards of one sharded group, got 1 state(s) "
        "written by groups of [2] rank(s); pass the newest checkpoint of every rank of the "
        "group that wrote it, in rank order"
    )
    one.load_states(states)
    for k, v in one.model.state_dict().items():
        assert torch.equal(v, expected["whole"][k]), k
    nll_step(one, demos())
    for k, v in one.model.state_dict().items():
        torch.testing.assert_close(v, expected["after"][k], rtol=0, atol=1e-12)


def test_one_whole_state_loads_through_load_states() -> None:
    trainer = make()
    nll_step(trainer, demos())
    other = make(seed=1)
    other.load_states([trainer.state()])
    for (k, a), b in zip(
        trainer.model.state_dict().items(), other.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), k


def test_set_dropout_sets_the_whole_models_mode_and_leaves_a_mode_it_is_in_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer = make()
    assert not any(m.training for m in trainer.model.modules())  # settings.dropout is off
    walks: list[bool] = []
    train = trainer.model.train

    def counted(mode: bool = True) -> Any:
        walks.append(mode)
        return train(mode)

    monkeypatch.setattr(trainer.model, "train", counted)
    trainer.set_dropout(False)
    assert walks == []  # already off: no module visited
    trainer.set_dropout(True)
    assert walks == [True]
    assert all(m.training for m in trainer.model.modules())
    trainer.set_dropout(True)
    assert walks == [True]
    # Log-probs are computed in eval mode, then the settings' mode (off) is put back.
    trainer.logprobs([s.sample for s in demos()])
    assert walks == [True, False]
    assert not any(m.training for m in trainer.model.modules())
