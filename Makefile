# rlk3: two commands, each doing all of its own setup on a fresh machine.
#   make test   the suite (what CI runs)         make demo   the main job (added by the demo issue)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# the venv is rebuilt only when the dependency declarations change
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)

.PHONY: test test-fast test-gpu lint setup system demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU build of torch that lies on disk, first and alone: nothing later may pull a CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test]'
	@rm -f $(VENV)/.installed-*
	@touch $@

# system packages and builds that parts of rlk3 need (bubblewrap, CRIU, Chromium, ...): one idempotent
# script per part under scripts/setup.d/, each skipped when its content hash is unchanged
system:
	@bash scripts/setup-system.sh

test: setup system
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not gpu" --durations=25 $(PYTEST_ARGS)

test-fast: setup system
	$(PY) -m pytest -m "not gpu and not slow" $(PYTEST_ARGS)

# on a GPU machine with its own torch/triton: `make test-gpu PY=python3`
test-gpu:
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .

# the main job: SFT -> nine effort-budget teachers -> MOPD student -> eval report, on k3-tiny (docs/demo.md)
demo: setup system
	RAY_AUTH_MODE=disabled $(PY) -m rlk3 demo configs/demo.yaml $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .cache/system
