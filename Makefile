# lorarl — the one entry point. `make test` and `make demo` work from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.lorarl-installed
EXTRAS ?= trainer,rollout,operator,dev
# torch first, pinned: the local CPU wheel; any other version pulls GBs of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test test-fast lint crds crds-check plan-example clean help

help:
	@echo "make setup   - create $(VENV) (torch first, then lorarl[$(EXTRAS)])"
	@echo "make test    - install and run the whole test suite (slow end-to-end tests included)"
	@echo "make lint    - ruff"
	@echo "make crds    - regenerate crds/ from the API models"

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	touch $@

# pytest exits 5 when it collects nothing; that is a failure here, like any other non-zero code.
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

crds: setup
	$(VENV)/bin/lorarl crds -o crds/lorarljobs.lorarl.dev.yaml

crds-check: crds
	git diff --exit-code crds/

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
