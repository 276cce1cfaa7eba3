#!/usr/bin/env bash
# The SGLang *contract* test env: SGLang's own argument parser, request types and HTTP app,
# importable on a CPU-only machine, so tests can pin our flags and payloads to them.
#
# Why not `pip install sglang`: it pins a CUDA torch, flashinfer, sgl-kernel, ... (many GBs, and
# nothing of it runs without a GPU). We install the CPU torch first, then sglang --no-deps, then
# only the light packages `sglang.srt.server_args`, `sglang.srt.managers.io_struct` and
# `sglang.srt.entrypoints.http_server` import (docs/architecture.md#measured-facts), under a torch constraint. Where
# SGLang's wheel pins one of them, its own pin is used. torchvision is deliberately absent (the
# PyPI build is CUDA-linked): the tests put a stand-in on sys.path instead.
#
# uv installs (as scripts/install_vllm_cpu.sh, and why); pip stays to read the wheel's METADATA.
#
# Usage: scripts/install_sglang_contract_env.sh [VENV_DIR]   (default .venv-sglang)
set -euo pipefail

VENV="${1:-.venv-sglang}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
UV_VERSION="${UV_VERSION:-0.13.9}"

# Import-time needs of the three modules above, measured with sglang 0.5.23 (docs/architecture.md#measured-facts).
LIGHT_DEPS=(
  numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pyzmq tqdm
  ipython pydantic aiohttp
  transformers dill apache-tvm-ffi sentencepiece compressed-tensors gguf openai
  partial-json-parser
  uvicorn uvloop fastapi setproctitle einops jsonschema xgrammar soundfile python-multipart
  httpx
)

start=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip)
UV=("$VENV/bin/uv" pip install --quiet --python "$PY")
# .pyc files at install, as pip writes them: non-root pods cannot write __pycache__ (Makefile).
export UV_COMPILE_BYTECODE="${UV_COMPILE_BYTECODE:-1}"
[ -z "${PIP_FIND_LINKS:-}" ] || export UV_FIND_LINKS="${UV_FIND_LINKS:-$PIP_FIND_LINKS}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"${PIP[@]}" install -q --upgrade pip "uv==${UV_VERSION}"
# CPU torch first (`2.13.0+cpu` from PIP_FIND_LINKS/UV_FIND_LINKS or UV_EXTRA_INDEX_URL wins).
"${UV[@]}" "torch==${TORCH_VERSION}"
# Where no index has the +cpu wheel, PyPI's CUDA build is used (same CPU kernels, more disk).
"$PY" -W ignore -c 'import torch; torch.version.cuda and print(f"note: torch {torch.__version__} is a CUDA build (no +cpu wheel on the index)")'

"${PIP[@]}" download -q "sglang==${SGLANG_VERSION}" --no-deps -d "$work/wheel"
wheel="$(ls "$work"/wheel/*.whl)"

# Each light dep with SGLang's own specifier when its METADATA pins one (transformers==5.19.0, ...).
"$PY" - "$wheel" "${LIGHT_DEPS[@]}" > "$work/requirements.txt" <<'PYEOF'
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

wheel, wanted = sys.argv[1], sys.argv[2:]
with zipfile.ZipFile(wheel) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    text = zf.read(meta).decode()
pinned = {}
for line in text.splitlines():
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            pinned[canonicalize_name(req.name)] = str(req.specifier)
for name in wanted:
    print(f"{name}{pinned.get(canonicalize_name(name), '')}")
PYEOF

# The distribution's version (2.13.0), not torch.__version__ (2.13.0+cu130 for PyPI's build).
torch_installed="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
echo "torch==${torch_installed}" > "$work/constraints.txt"
echo "== sglang ${SGLANG_VERSION} light deps: $(tr '\n' ' ' < "$work/requirements.txt")"
"${UV[@]}" -r "$work/requirements.txt" -c "$work/constraints.txt"
"${UV[@]}" --no-deps "$wheel"
"$PY" -c 'import importlib.metadata as m, sys; v = m.version("torch"); sys.exit(0 if v == sys.argv[1] else f"torch {v} replaced {sys.argv[1]}")' "$torch_installed"
# The modules the contract tests use must import (with the torchvision stand-in first).
stubs="$(cd "$(dirname "$0")/.." && pwd)/tests/contract/sglang_stubs"
PYTHONPATH="$stubs" "$PY" -W ignore -c '
import sglang.srt.server_args, sglang.srt.managers.io_struct, sglang.srt.entrypoints.http_server
import sglang, torch
print("torch", torch.__version__, "sglang", sglang.__version__, "- contract modules import")'
echo "== installed in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
