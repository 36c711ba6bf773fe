"""A plain single-process PyTorch GRPO loop on the main job's task: the baseline of ``asyncrl
bench learning``.

No runtime: one process, no roles, no messages. Each step generates, scores and trains, in
turn, on the main job's model (``examples/arith/bc_grpo.yaml``'s ``model.config``) with what the
shipped manifest asks of asyncrl:

- **sampling**: temperature 1.0, at most 5 new tokens, stopping at the end-of-sequence token;
  prompts in the prompt source's order (the RL prompts of ``examples.arith.data``, each epoch
  shuffled by ``random.Random(f"{seed}:{epoch}")``, as ``PromptSource`` with ``shuffle_seed``);
- **dynamic sampling** as the manifest's pipeline does it: a new group starts with one sample
  (``probe: 1``), dropped when the policy drew it with probability 0.9 or more
  (``confidence: 0.9``); a group whose 8 rewards are all equal is dropped (``drop_uniform``);
  both kinds of drop count against a cap of 3 per group of the batch
  (``uniform_drops_per_group``), past which uniform groups are kept. The schedule's deferral
  of prompts by their history (``skip_uniform``) is not reproduced: prompts come in order;
- **reward**: exact match of the decoded completion with the answer (the ``exact`` verifier);
- **training**: GRPO's group advantages (population std), PPO's clipped surrogate (0.2) over
  token means, against the behaviour log-probs of the sampling, one AdamW step (lr 1e-3,
  gradient norm clipped at 1.0), dropout off; the loss and advantages are asyncrl's own
  functions (``asyncrl.roles.learning.algorithms``), so only the loop differs.

``behaviour_cloning`` makes the BC checkpoint every arm of the bench starts from, and
``greedy_accuracy`` is the plain loop's held-out evaluation (greedy, exact match).
"""

from __future__ import annotations

import inspect
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import yaml
from torch import Tensor

from asyncrl.roles.learning import algorithms as alg
from examples.arith import data

__all__ = [
    "MANIFEST",
    "TOKENIZER",
    "Arith",
    "PlainGRPO",
    "behaviour_cloning",
    "build_model",
    "greedy_accuracy",
    "model_config",
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, "examples", "arith", "bc_grpo.yaml")
"""The main job's manifest: its model, sampling and pipeline are the bench's."""
TOKENIZER = os.path.join(ROOT, "examples", "arith", "tokenizer")
MAX_NEW_TOKENS = 5
TEMPERATURE = 1.0
CONFIDENCE = 0.9  # the manifest's pipeline.schedule.confidence
DROPS_PER_GROUP = 3  # the manifest's pipeline.uniform_drops_per_group


def model_config() -> dict[str, Any]:
    """The main job's model config (``model.config`` of ``MANIFEST``)."""
    with open(MANIFEST) as f:
        config: dict[str, Any] = yaml.safe_load(f)["model"]["config"]
    return config


def build_model(config: dict[str, Any], seed: int) -> Any:
    """A causal LM with random weights from ``config`` (transformers' keywords), seeded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    auto: Any = AutoModelForCausalLM
    return auto.from_config(AutoConfig.for_model(**config))


class Arith:
    """The task's text side: the tokenizer, the held-out set and the RL prompts, as tensors."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(TOKENIZER)
        self.eos: int = self.tok.eos_token_id
        self.pad: int = self.tok.pad_token_id
        rows = data.heldout()
        self.heldout_ids = torch.tensor([self.tok.encode(r["prompt"]) for r in rows])
        self.heldout_answers = [r["answer"] for r in rows]
        self.rl_rows = list(data.rl_prompts())
        self.rl_ids = torch.tensor([self.tok.encode(r["prompt"]) for r in self.rl_rows])

    def decode(self, completions: Tensor) -> list[str]:
        """Each row's completion as text: special tokens (end of sequence, padding) left out."""
        texts: list[str] = self.tok.batch_decode(completions.tolist(), skip_special_tokens=True)
        return texts

    def rewards(self, completions: Tensor, answers: Sequence[str]) -> Tensor:
        """The ``exact`` verifier: 1.0 where the stripped completion equals the answer."""
        texts = self.decode(completions)
        return torch.tensor(
            [float(t.strip() == a.strip()) for t, a in zip(texts, answers, strict=True)]
        )

    def prompts(self, seed: int) -> Iterator[int]:
        """Indices of ``rl_rows`` in the prompt source's order under ``shuffle_seed=seed``."""
        epoch = 0
        while True:
            perm = list(range(len(self.rl_rows)))
            random.Random(f"{seed}:{epoch}").shuffle(perm)
            yield from perm
            epoch += 1


@torch.no_grad()
def _decode(
    model: Any,
    prompts: Tensor,
    eos: int,
    pad: int,
    *,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Up to ``MAX_NEW_TOKENS`` tokens after each of ``prompts`` [B, P] (all one length):
    the completions [B, T] (padding after the end-of-sequence token), their behaviour log-probs
    [B, T] and their mask [B, T] (1 up to and with the end-of-sequence token)."""
    finished = torch.zeros(len(prompts), dtype=torch.bool)
    tokens, logps, masks = [], [], []
    cache = None
    step_input = prompts
    # transformers 5 renamed past_key_values to cache (the old name warns).
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for i in range(MAX_NEW_TOKENS):
        attention = torch.ones(len(prompts), prompts.shape[1] + i, dtype=torch.long)
        out = model(input_ids=step_input, attention_mask=attention, use_cache=True, **{kw: cache})
        cache = getattr(out, kw)
        logits = out.logits[:, -1].float()
        if greedy:
            token = logits.argmax(-1)
            logp = torch.zeros(len(prompts))
        else:
            logprobs = torch.log_softmax(logits / TEMPERATURE, -1)
            token = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1)
            logp = logprobs.gather(1, token[:, None]).squeeze(1)
        live = ~finished
        tokens.append(torch.where(live, token, pad))
        logps.append(torch.where(live, logp, 0.0))
        masks.append(live.float())
        finished = finished | (token == eos)
        if bool(finished.all()):
            break
        step_input = tokens[-1][:, None]
    return torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(masks, 1)


def greedy_accuracy(model: Any, task: Arith, batch: int = 1000) -> float:
    """Held-out greedy accuracy: the share of the 1,000 held-out problems whose greedy
    completion is exactly the answer."""
    was_training = model.training
    model.eval()
    correct = 0.0
    for start in range(0, len(task.heldout_ids), batch):
        ids = task.heldout_ids[start : start + batch]
        completions, _, _ = _decode(model, ids, task.eos, task.pad, greedy=True)
        answers = task.heldout_answers[start : start + batch]
        correct += float(task.rewards(completions, answers).sum())
    model.train(was_training)
    return correct / len(task.heldout_ids)


def behaviour_cloning(
    task: Arith, out_dir: str, *, steps: int, seed: int = 0, demos: int = 200
) -> dict[str, Any]:
    """BC from random weights as the main job does it (``demos`` demonstrations, batches of
    50, AdamW at 1e-3, gradient norm clipped at 1.0, dropout on) for ``steps`` steps; the model
    saved to ``out_dir`` (Hugging Face format). Returns ``steps``, ``accuracy`` (held-out,
    greedy) and ``seconds``."""
    t0 = time.perf_counter()
    model = build_model(model_config(), seed)
    rows = data.demonstrations(demos)
    prompts = torch.tensor([task.tok.encode(r["prompt"]) for r in rows])
    answers = [[*task.tok.encode(r["answer"], add_special_tokens=False), task.eos] for r in rows]
    targets = torch.tensor(answers)  # fixed width: 3 digits and the end-of-sequence token
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(steps):
        pick = random.Random(f"{seed}-bc-{step}").sample(range(len(rows)), 50)
        ids = torch.cat([prompts[pick], targets[pick]], 1)
        logits = model(input_ids=ids).logits[:, prompts.shape[1] - 1 : -1].float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[pick].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    accuracy = greedy_accuracy(model, task)
    model.save_pretrained(out_dir)
    return {"steps": steps, "accuracy": accuracy, "seconds": time.perf_counter() - t0}


@dataclass
class _Groups:
    """The groups a batch has gathered: prompt rows, completions, log-probs, masks, rewards."""

    rows: list[int] = field(default_factory=list)
    completions: list[Tensor] = field(default_factory=list)
    logprobs: list[Tensor] = field(default_factory=list)
    masks: list[Tensor] = field(default_factory=list)
    rewards: list[Tensor] = field(default_factory=list)


class PlainGRPO:
    """The plain loop (see the module docstring): ``step()`` generates, scores and trains once.

    Args:
        model_path: the BC checkpoint to start from.
        task: the task's tokenizer and prompts.
        seed: seeds the prompt order and the sampling.
        prompts_per_step, group_size: the batch: groups, and samples per group.
    """

    def __init__(
        self, model_path: str, task: Arith, *, seed: int, prompts_per_step: int, group_size: int
    ) -> None:
        from transformers import AutoModelForCausalLM

        auto: Any = AutoModelForCausalLM  # its class methods are untyped
        self.model: Any = auto.from_pretrained(model_path)
        self.model.eval()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.task = task
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.order = task.prompts(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.generated = 0  # samples generated, dropped ones included
        self.trained = 0  # samples trained on

    def _sample(self, rows: list[int], n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``n`` samples of each prompt of ``rows`` (row-major), with their rewards."""
        index = torch.tensor(rows).repeat_interleave(n)
        completions, logprobs, masks = _decode(
            self.model,
            self.task.rl_ids[index],
            self.task.eos,
            self.task.pad,
            greedy=False,
            generator=self.generator,
        )
        self.generated += len(index)
        answers = [self.task.rl_rows[int(i)]["answer"] for i in index]
        return completions, logprobs, masks, self.task.rewards(completions, answers)

    def _gather(self) -> _Groups:
        """A batch of ``prompts_per_step`` groups, by dynamic sampling (the module docstring)."""
        got, drops = _Groups(), 0
        cap = DROPS_PER_GROUP * self.prompts_per_step
        while len(got.rows) < self.prompts_per_step:
            rows = [next(self.order) for _ in range(self.prompts_per_step - len(got.rows))]
            c, lp, m, r = self._sample(rows, 1)
            confident = lp.sum(1).exp() >= CONFIDENCE
            keep = []
            for i in range(len(rows)):
                if confident[i] and drops < cap:
                    drops += 1
                else:
                    keep.append(i)
            if not keep:
                continue
            rest = self._sample([rows[i] for i in keep], self.group_size - 1)
            for j, i in enumerate(keep):
                span = slice(j * (self.group_size - 1), (j + 1) * (self.group_size - 1))
                group = [
                    _pad_cat2(c[i : i + 1], rest[0][span], self.task.pad),
                    _pad_cat2(lp[i : i + 1], rest[1][span], 0.0),
                    _pad_cat2(m[i : i + 1], rest[2][span], 0.0),
                    torch.cat([r[i : i + 1], rest[3][span]]),
                ]
                uniform = bool((group[3] == group[3][0]).all())
                if uniform and drops < cap:
                    drops += 1
                    continue
                got.rows.append(rows[i])
                got.completions.append(group[0])
                got.logprobs.append(group[1])
                got.masks.append(group[2])
                got.rewards.append(group[3])
        return got

    def step(self) -> dict[str, float]:
        """Generate and score a batch, then one GRPO step on it. Returns the batch's mean
        ``reward`` and the step's ``loss``."""
        got = self._gather()
        width = max(c.shape[1] for c in got.completions)
        completions = torch.cat([_widen(c, width, self.task.pad) for c in got.completions])
        old = torch.cat([_widen(x, width, 0.0) for x in got.logprobs])
        mask = torch.cat([_widen(x, width, 0.0) for x in got.masks])
        rewards = torch.cat(got.rewards)
        groups = torch.arange(len(got.rows)).repeat_interleave(self.group_size)
        prompts = self.task.rl_ids[torch.tensor(got.rows).repeat_interleave(self.group_size)]
        ids = torch.cat([prompts, completions], 1)
        attention = torch.cat([torch.ones_like(prompts), mask.long()], 1)
        logits = self.model(input_ids=ids, attention_mask=attention).logits
        start = prompts.shape[1] - 1
        logprobs = alg.token_logprobs(logits[:, start:-1].float(), completions)
        adv = alg.grpo_advantages(rewards, groups)
        loss, _ = alg.ppo_policy_loss(logprobs, old, adv[:, None].expand_as(mask) * mask, mask, 0.2)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.trained += len(rewards)
        return {"reward": float(rewards.mean()), "loss": float(loss.detach())}


def _widen(x: Tensor, width: int, fill: float) -> Tensor:
    """``x`` [B, T] padded on the right with ``fill`` to ``width`` columns."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill)


def _pad_cat2(a: Tensor, b: Tensor, fill: float) -> Tensor:
    width = max(a.shape[1], b.shape[1])
    return torch.cat([_widen(a, width, fill), _widen(b, width, fill)])
