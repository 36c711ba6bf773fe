# One target per habit. Every target sets up .venv first if it is missing or stale.
#   make run     set up, then run the main job (BC then GRPO on addition, on CPU)
#   make test    set up, then run the whole test suite
#   make lint    ruff (lint + format check) and mypy
#   make bench   the benchmarks, with their baselines, as tables

PYTHON ?= python3.11
# On machines with a local CPU build of torch this pin is quick; elsewhere override it, e.g.
# make TORCH=torch test. The package itself never pins torch.
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test test-fast lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev,examples]"
	touch $(STAMP)

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

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/asyncrl bench transport
	$(BIN)/asyncrl bench runtime
	$(BIN)/asyncrl bench learner
	$(BIN)/asyncrl bench pipeline

clean:
	rm -rf $(VENV) build .mypy_cache .ruff_cache .pytest_cache .hypothesis
