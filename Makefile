# One-command entry points; the README and .ci/run use exactly these.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# torch, CPU build. On Linux x86_64 PyPI's torch (pinned or not) is the CUDA build with several GB of
# nvidia-* wheels, so setup first asks PyTorch's CPU index (TORCH_INDEX; PyPI for the dependencies) for
# torch==$(TORCH_VERSION)+cpu. If that fails (the index is unreachable: --timeout 5 --retries 0 keep
# this quick; or it has no +cpu wheel for this platform, e.g. macOS, whose PyPI wheel is CPU-only)
# it installs torch==$(TORCH_VERSION) from the default index instead, and prints which build it got.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX_ARGS = --timeout 5 --retries 0 --index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple
QUICKSTART_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup quickstart test test-slow lint bench clean gpu-check

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_INDEX_ARGS) 'torch==$(TORCH_VERSION)+cpu' \
	    || { echo "setup: no torch $(TORCH_VERSION)+cpu from $(TORCH_INDEX); installing torch==$(TORCH_VERSION) from the default index"; \
	         $(BIN)/pip install -q 'torch==$(TORCH_VERSION)'; }
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python -c "import torch; print('setup: torch', torch.__version__, '(CUDA ' + torch.version.cuda + ')' if torch.version.cuda else '(CPU build)')"
	touch $@

quickstart: setup
	$(BIN)/swarmtrain demo --preset tiny $(QUICKSTART_ARGS)

# the size bounds of docs/DESIGN.md section 3 are tests/unit/test_size_ratchet.py (run by `test`); the
# duplicate-code ratchet is tools/check_duplicates.py (pylint's similarity checker, ~7 s), run beside mypy
# (~9 s on a clean clone): both one core each, so on two cores lint takes the longer of them, not the sum
lint: setup
	$(BIN)/ruff check src tests bench experiments tools
	$(BIN)/lint-imports
	$(BIN)/python tools/check_duplicates.py & duplicates=$$!; \
	    $(BIN)/mypy; mypy=$$?; \
	    wait $$duplicates && test $$mypy -eq 0

# the default tier (unit, integration, faults: <= 12 minutes on 2 cores); `test-slow` runs the long ones
# (chaos schedules, end-to-end user flows, long parity runs: <= 20 minutes). CI runs both. Unit tests run
# on every core (pytest-xdist). Swarm tests run two at a time (one alone left ~30% of two cores idle:
# process starts, DHT waits, timeouts), a module per worker and never two `timed` ones side by side
# (tests/conftest.py); those marked `serial` run alone after them
test: lint
	$(BIN)/pytest tests/unit -m "not slow" -n auto $(PYTEST_ARGS)
	$(BIN)/pytest tests/integration tests/faults -m "not slow and not serial" -n 2 --dist loadgroup $(PYTEST_ARGS)
	$(BIN)/pytest tests/integration tests/faults -m "not slow and serial" $(PYTEST_ARGS)

test-slow: setup
	$(BIN)/pytest -m slow $(PYTEST_ARGS)

bench: setup
	$(BIN)/python bench/local_baseline.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache

# The GPU check (issue 53), on a CUDA machine: the gpu tests, bench/device_stage.py for gpt2-small and
# llama-125m in bf16 and fp32 and the host path, in one table (tools/gpu/check.sh). WHEELS=DIR installs
# a wheelhouse from tools/gpu/wheelhouse.sh offline first (for machines without internet access)
WHEELS ?=
gpu-check:
	PYTHON=$(if $(wildcard $(BIN)/python),$(BIN)/python,python3) bash tools/gpu/check.sh $(WHEELS)
