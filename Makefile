# One-command entry points; the README and .ci/run use exactly these.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# CPU build of torch from the local wheel cache: an unpinned torch pulls a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
QUICKSTART_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup quickstart test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

quickstart: setup
	$(BIN)/swarmtrain demo --preset tiny $(QUICKSTART_ARGS)

lint: setup
	$(BIN)/ruff check src tests bench experiments
	$(BIN)/lint-imports
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -m "not slow and not gpu" $(PYTEST_ARGS)

bench: setup
	$(BIN)/python bench/local_baseline.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
