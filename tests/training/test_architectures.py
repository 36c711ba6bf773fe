"""Qwen2 (Qwen2.5), Qwen3 and Llama-3 end to end, built from tiny configs (no download).

Each architecture, with tied and untied embeddings, goes through the rollout engine, the learner,
the shared-memory weight store, the reference, the critic and export, in-process: grouped-query
attention (2 key/value heads for 4 query heads), RoPE with positions taken from the attention
mask of left-padded batches, RMSNorm, SwiGLU. The tokenizers are the character-level ones shipped
in ``examples/qwen/`` (``tokenizer/`` with Qwen's special tokens and chat template,
``llama3_tokenizer/`` with Llama-3's), loaded as a user loads them, through ``AutoTokenizer``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from functools import cache
from typing import Any

import pytest
import torch

from asyncrl.manifest.load import load_manifest
from asyncrl.role import RoleContext
from asyncrl.roles.generation.engine import HFEngine
from asyncrl.roles.generation.rollout import Rollout, Sample, WeightsUpdate
from asyncrl.roles.payloads import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    SamplingParams,
    ScoreSamples,
)
from asyncrl.roles.services.reference import Reference
from asyncrl.roles.services.reward import Reward
from asyncrl.roles.training.critic import Critic
from asyncrl.roles.training.learner import Learner, Scored, TrainBatch
from tests.conftest import ROOT

ARCHS = ["qwen2", "qwen3", "llama"]
TOKENIZERS = {"qwen": "examples/qwen/tokenizer", "llama": "examples/qwen/llama3_tokenizer"}
FAMILY = {"qwen2": "qwen", "qwen3": "qwen", "llama": "llama"}

LLAMA3_ROPE: dict[str, Any] = {
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}
"""Llama-3.1's RoPE (theta 500k, frequencies rescaled by wavelength), with an original context
short enough that the rescaling changes some of the tiny model's frequencies."""

CHAT = {
    "qwen": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n<|im_start|>user\n07+45=<|im_end|>\n<|im_start|>assistant\n",
    "llama": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n07+45=<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
}
"""The chat template of one user turn with the generation prompt, as each family renders it."""


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@cache
def tokenizer(family: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(ROOT, TOKENIZERS[family]))


def model_config(arch: str, tied: bool) -> dict[str, Any]:
    """A tiny config of ``arch``: 2 layers, hidden 64, 4 query and 2 key/value heads, the
    vocabulary and special token ids of its family's tokenizer."""
    tok = tokenizer(FAMILY[arch])
    config: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": tied,
        # Qwen2.5's config names <|endoftext|> as its BOS, though its tokenizer adds none.
        "bos_token_id": tok.bos_token_id if tok.bos_token_id is not None else tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    if arch == "qwen3":
        config["head_dim"] = 16
    if arch == "llama":
        config.update(LLAMA3_ROPE)
    return config


def prompts(arch: str) -> list[list[int]]:
    """Prompts of three lengths, so every batch is left-padded: two sums and a chat turn."""
    tok = tokenizer(FAMILY[arch])
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "7+8="}], add_generation_prompt=True, return_dict=True
    )
    return [tok.encode("07+45="), tok.encode("123+456+7="), list(chat["input_ids"])]


def requests(arch: str, group: int = 1, **params: Any) -> list[GenerateRequest]:
    """``group`` requests of each of ``prompts(arch)``, seeded apart, stopping on the EOS."""
    eos = tokenizer(FAMILY[arch]).eos_token_id
    sampling = SamplingParams(**{"max_new_tokens": 6, "stop_token_ids": [eos], **params})
    return [
        GenerateRequest(
            prompt=Prompt(id=f"p{i}", token_ids=ids),
            sample_index=k,
            params=sampling,
            seed=10 * i + k,
        )
        for i, ids in enumerate(prompts(arch))
        for k in range(group)
    ]


def grpo_batch(samples: list[Sample]) -> TrainBatch:
    """GRPO on ``samples``, the first of each prompt's group rewarded."""
    return TrainBatch(
        samples=[Scored(sample=s, reward=float(s.sample_index == 0)) for s in samples],
        algorithm="grpo",
    )


def unstarted_learner(tmp_path: Any, arch: str, tied: bool, **config: Any) -> Learner:
    """A learner of ``arch`` (not set up), with its family's tokenizer for export, not durable
    (no checkpoint per step), publishing no weights unless ``publish_weights`` says so."""
    ctx = RoleContext.local(
        config={
            "model_config": model_config(arch, tied),
            "tokenizer_path": os.path.join(ROOT, TOKENIZERS[FAMILY[arch]]),
            "pad_id": tokenizer(FAMILY[arch]).pad_token_id,
            "seed": 1,
            "durable": False,
            "publish_weights": False,
            **config,
        },
        run_dir=str(tmp_path),
        name="learner",
        run=f"arch-{os.getpid()}-{arch}",
    )
    return Learner(ctx)


def learner_for(tmp_path: Any, arch: str, tied: bool, **config: Any) -> Learner:
    """``unstarted_learner``, set up."""
    learner = unstarted_learner(tmp_path, arch, tied, **config)
    asyncio.run(learner.setup())
    return learner


def assert_close(got: list[list[float]], want: list[list[float]], atol: float) -> None:
    assert [len(g) for g in got] == [len(w) for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=atol, rtol=0)


def same_weights(a: Any, b: Any) -> list[str]:
    """The tensors of two models' state dicts that differ (in value, shape or presence)."""
    sa, sb = a.state_dict(), b.state_dict()
    return sorted(
        name
        for name in sa.keys() | sb.keys()
        if name not in sa or name not in sb or not torch.equal(sa[name], sb[name])
    )


def tied_in(model: Any) -> bool:
    """Whether the model's output projection is its input embedding (one tensor)."""
    out, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    return bool(out.data_ptr() == embed.data_ptr())


# -- tokenizers --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_tokenizer_carries_its_familys_special_tokens_and_chat_template(family: str) -> None:
    tok = tokenizer(family)
    turn = [{"role": "user", "content": "07+45="}]
    assert tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) == CHAT[family]
    chat = list(
        tok.apply_chat_template(turn, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
    assert tok.decode(chat) == CHAT[family]
    digits = tok.convert_tokens_to_ids(list("07+45="))
    if family == "qwen":
        # Qwen2.5 and Qwen3: no BOS; <|im_end|> ends a turn and is the EOS; <|endoftext|> pads.
        assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
            None,
            "<|im_end|>",
            "<|endoftext|>",
        )
        assert tok.encode("07+45=") == digits
        assert chat.count(tok.eos_token_id) == 2  # the system and the user turns end with it
    else:
        # Llama-3: <|begin_of_text|> once at the start of every text (the chat template's too,
        # never twice); <|eot_id|> ends a turn and is the instruct models' EOS.
        assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
        assert tok.pad_token == "<|finetune_right_pad_id|>"
        assert tok.encode("07+45=") == [tok.bos_token_id, *digits]
        assert chat.count(tok.bos_token_id) == 1 and chat[0] == tok.bos_token_id
        assert chat.count(tok.eos_token_id) == 1
        assert tok.convert_ids_to_tokens(tok.encode("x", add_special_tokens=False)) == ["x"]
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} - {None}) == len(
        {tok.bos_token, tok.eos_token, tok.pad_token} - {None}
    )
    # What the reward sees of a completion that stopped on the EOS: the answer alone.
    answer = tok.encode("052", add_special_tokens=False)
    assert tok.decode([*answer, tok.eos_token_id], skip_special_tokens=True) == "052"


def test_the_shipped_tokenizers_are_what_their_builder_writes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "examples.qwen.make_tokenizers", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# -- rollout, learner, weight store, reference -----------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_behaviour_logprobs_weights_and_reference_agree(
    tmp_path: Any, arch: str, tied: bool
) -> None:
    """The rollout loads the learner's weights from shared memory bit for bit, its behaviour
    log-probs of left-padded batches are the learner's recompute (1e-5, float32), a GRPO step
    changes the weights and the next sync delivers exactly them, and the reference scores as
    the learner does."""

    async def go() -> None:
        learner = unstarted_learner(tmp_path, arch, tied, lr=0.01, publish_weights=True)
        await learner.setup()
        assert tied_in(learner.trainer.model) == tied
        assert (
            learner.trainer.model.config.num_key_value_heads
            < learner.trainer.model.config.num_attention_heads
        )
        rollout = Rollout(
            RoleContext.local(
                config={
                    "model_config": model_config(arch, tied),
                    "seed": 7,
                    "weights_from": "learner",
                },
                run_dir=str(tmp_path),
                name="rollout",
                run=learner.ctx.run,
            )
        )
        await rollout.setup()
        engine = rollout.engine
        assert isinstance(engine, HFEngine)
        assert same_weights(engine.model, learner.trainer.model) == []
        assert tied_in(engine.model) == tied

        samples = await rollout.generate(GenerateBatch(requests(arch, 2, temperature=1.0)))
        eos = tokenizer(FAMILY[arch]).eos_token_id
        assert all(
            (len(s.token_ids), s.stop_reason) == (6, "length")
            or (s.token_ids[-1], s.stop_reason) == (eos, "stop")
            for s in samples
        )
        assert_close(learner.trainer.logprobs(samples), [s.logprobs for s in samples], atol=1e-5)

        before = {k: v.clone() for k, v in learner.trainer.model.state_dict().items()}
        result = learner.train(grpo_batch(samples))
        assert (result.version, result.consumed) == (1, 6)
        changed = [
            k
            for k, v in learner.trainer.model.state_dict().items()
            if not torch.equal(v, before[k])
        ]
        assert "model.embed_tokens.weight" in changed and "lm_head.weight" in changed

        assert await rollout.sync(None) == 1
        assert same_weights(engine.model, learner.trainer.model) == []
        assert tied_in(engine.model) == tied  # loading both names kept the one tensor
        again = await rollout.generate(GenerateBatch(requests(arch, temperature=1.0)))
        assert all(s.versions == [1] * len(s.token_ids) for s in again)
        assert_close(learner.trainer.logprobs(again), [s.logprobs for s in again], atol=1e-5)

        reference = Reference(
            RoleContext.local(config={"model_config": model_config(arch, tied), "seed": 9})
        )
        await reference.setup()
        state = {k: v.clone() for k, v in learner.trainer.model.state_dict().items()}
        assert await reference.set_weights(WeightsUpdate(1, state)) == 1
        assert_close(await reference.logprobs(again), learner.trainer.logprobs(again), atol=1e-5)
        await rollout.teardown()
        await learner.teardown()

    asyncio.run(go())


@pytest.mark.parametrize("arch", ARCHS)
def test_a_demonstration_is_learnt_and_generation_stops_on_the_eos(
    tmp_path: Any, arch: str
) -> None:
    """BC on one demonstration (``07+45=`` -> ``052`` then the EOS, the prompt with the BOS where
    the family has one): greedy decoding then stops on the tokenizer's EOS, and the reward,
    decoding with that tokenizer, scores the completion 1."""
    family = FAMILY[arch]
    tok = tokenizer(family)
    learner = learner_for(tmp_path, arch, tied=True, lr=0.01)
    prompt = tok.encode("07+45=")
    answer = [*tok.encode("052", add_special_tokens=False), tok.eos_token_id]
    for step in range(40):
        demo = Sample(
            prompt_id=f"d{step}",
            sample_index=0,
            prompt_ids=prompt,
            token_ids=answer,
            logprobs=[],
            versions=[],
            finished=True,
            stop_reason="stop",
        )
        learner.train(TrainBatch(samples=[Scored(sample=demo)], algorithm="bc"))
    engine = HFEngine.from_config(model_config(arch, True), seed=3)
    engine.set_weights(learner.trainer.model.state_dict(), learner.version)
    params = SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=[tok.eos_token_id])
    (sample,) = engine.generate(
        [
            GenerateRequest(
                prompt=Prompt(id="q", token_ids=prompt, answer="052"), sample_index=0, params=params
            )
        ]
    )
    assert (sample.token_ids, sample.stop_reason) == (answer, "stop")

    async def score() -> list[float]:
        reward = Reward(
            RoleContext.local(
                config={
                    "verifier": "exact",
                    "tokenizer_path": os.path.join(ROOT, TOKENIZERS[family]),
                }
            )
        )
        await reward.setup()
        scores: list[float] = await reward.score_samples(ScoreSamples([sample], ["052"]))
        return scores

    assert asyncio.run(score()) == [1.0]


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_invariant_decoding_pads_rope_models_without_moving_a_row(arch: str) -> None:
    """With ``batch_invariant`` every batch is padded to the model's positions: a row's tokens
    and log-probs are the same alone and beside others, to the bit."""
    engine = HFEngine.from_config(
        model_config(arch, False), seed=2, max_batch=4, batch_invariant=True
    )
    batch = engine.generate(requests(arch, temperature=1.0))
    alone = [engine.generate([r])[0] for r in requests(arch, temperature=1.0)]
    assert [(s.token_ids, s.logprobs) for s in batch] == [(s.token_ids, s.logprobs) for s in alone]


# -- export -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_export_reloads_with_transformers_and_generates_the_same(
    tmp_path: Any, arch: str, tied: bool
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    learner = learner_for(tmp_path, arch, tied, lr=0.01)
    samples = HFEngine.from_config(model_config(arch, tied), seed=4).generate(
        requests(arch, 2, temperature=1.0)
    )
    before = {k: v.clone() for k, v in learner.trainer.model.state_dict().items()}
    learner.train(grpo_batch(samples))
    assert not torch.equal(
        before["lm_head.weight"], learner.trainer.model.state_dict()["lm_head.weight"]
    )
    path = asyncio.run(learner.export(os.path.join(str(tmp_path), "exports", "final")))

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch and model.config.tie_word_embeddings == tied
    assert tied_in(model) == tied
    assert same_weights(model, learner.trainer.model) == []
    tok = AutoTokenizer.from_pretrained(path)
    family = FAMILY[arch]
    assert (tok.eos_token, tok.bos_token) == (
        tokenizer(family).eos_token,
        tokenizer(family).bos_token,
    )
    turn = [{"role": "user", "content": "07+45="}]
    assert tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) == CHAT[family]

    exported = HFEngine.from_pretrained(path)
    trained = HFEngine(learner.trainer.model)
    greedy = requests(arch, greedy=True)
    assert [s.token_ids for s in exported.generate(greedy)] == [
        s.token_ids for s in trained.generate(greedy)
    ]
    learner.trainer.model.train(False)


# -- critic -------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_critic_values_line_up_with_completion_tokens(tmp_path: Any, arch: str) -> None:
    """The critic's value head on each architecture: one value per completion token, the same
    in a padded batch as alone; a train step moves the values towards the returns; a critic
    loaded from an exported policy keeps the policy's body."""

    async def go() -> None:
        samples = HFEngine.from_config(model_config(arch, True), seed=5).generate(
            requests(arch, temperature=1.0, max_new_tokens=4)
        )
        critic = Critic(
            RoleContext.local(
                config={
                    "model_config": model_config(arch, True),
                    "pad_id": tokenizer(FAMILY[arch]).pad_token_id,
                    "lr": 0.01,
                    "clip_eps": None,
                }
            )
        )
        await critic.setup()
        values = await critic.values(samples)
        assert [len(v) for v in values] == [len(s.token_ids) for s in samples]
        alone = [(await critic.values([s]))[0] for s in samples]
        assert_close(values, alone, atol=1e-5)

        batch = [
            Scored(sample=s, reward=1.0, values=v) for s, v in zip(samples, values, strict=True)
        ]
        losses = [(await critic.train_step(batch)).value_loss for _ in range(5)]
        assert losses[-1] < losses[0]

        learner = unstarted_learner(tmp_path, arch, tied=True)
        await learner.setup()
        path = await learner.export(os.path.join(str(tmp_path), "exports", "policy"))
        loaded = Critic(RoleContext.local(config={"model_path": path}))
        await loaded.setup()
        body, policy = loaded.trainer.model.state_dict(), learner.trainer.model.state_dict()
        shared = [k for k in body if k.startswith("model.")]
        assert shared and all(torch.equal(body[k], policy[k]) for k in shared)
        assert [len(v) for v in await loaded.values(samples)] == [len(s.token_ids) for s in samples]

    asyncio.run(go())


# -- the example --------------------------------------------------------------------------------


def test_the_qwen_example_is_a_tiny_qwen2_that_fits_its_tokenizer() -> None:
    """``examples/qwen/bc_grpo.yaml``: a Qwen2 with grouped-query attention and tied embeddings,
    of about a million parameters, whose vocabulary and special ids are its tokenizer's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    manifest = load_manifest(os.path.join(ROOT, "examples", "qwen", "bc_grpo.yaml"))
    assert manifest.run.program == "examples.arith.program:main"
    assert manifest.run.config["tokenizer"] == manifest.model.tokenizer == TOKENIZERS["qwen"]
    fields = dict(manifest.model.config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    tok = tokenizer("qwen")
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.vocab_size == len(tok)
    assert (config.eos_token_id, config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert manifest.roles["learner"].config["pad_id"] == tok.pad_token_id
    auto: Any = AutoModelForCausalLM  # its class methods are untyped
    params = sum(p.numel() for p in auto.from_config(config).parameters())
    assert 5e5 < params < 2e6


def test_the_gpu_recipe_in_the_readme_is_a_valid_manifest() -> None:
    """The README's GPU command: the same manifest loads with its overrides, the checkpoint in
    place of the config, for every role, and the program's tokenizer the checkpoint's."""
    import re
    import shlex

    with open(os.path.join(ROOT, "examples", "qwen", "README.md")) as f:
        blocks = re.findall(r"```sh\n(.*?)```", f.read(), re.S)
    (command,) = [b for b in blocks if "model.path=" in b]
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:3] == ["asyncrl", "run", "examples/qwen/bc_grpo.yaml"]
    overrides = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    manifest = load_manifest(os.path.join(ROOT, words[2]), overrides)
    checkpoint = "Qwen/Qwen2.5-0.5B-Instruct"
    assert (manifest.model.path, manifest.model.config) == (checkpoint, {})
    assert manifest.model.tokenizer == manifest.run.config["tokenizer"] == checkpoint
    assert manifest.run.env["ASYNCRL_PLUGIN"] == "cuda"
    assert {manifest.roles[r].placement.device for r in ("rollout", "learner")} == {"cuda:0"}
