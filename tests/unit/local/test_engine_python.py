"""How `lorarl run --local` finds the engines' interpreter (issue 20).

A venv's `bin/python` is a symlink out of the venv; following it (`Path.resolve()`) lands on the
base interpreter, which cannot import the venv's packages, and every engine then dies with
`No module named 'vllm'`. These tests build a real venv (no pip, ~0.1 s) holding a stand-in
`vllm` package, so a lookup that resolves the symlink fails them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorarl.local import engine_python as ep


@pytest.fixture(scope="module")
def engine_venv(tmp_path_factory) -> Path:
    """<tmp>/.venv-engine: a real venv whose python is a symlink, with an importable `vllm`."""
    root = tmp_path_factory.mktemp("checkout")
    venv = root / ep.ENGINE_VENV
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "vllm").mkdir(parents=True)
    (Path(purelib) / "vllm" / "__init__.py").write_text("")
    assert python.is_symlink() and not ep.has_module(python.resolve(), "vllm")
    return root


def test_the_venv_python_is_kept_not_resolved(engine_venv: Path, tmp_path: Path):
    found = ep.find_engine_python(env={}, cwd=engine_venv, root=tmp_path)
    assert found == str(engine_venv / ".venv-engine" / "bin" / "python")
    assert ep.has_module(found, "vllm")


def test_found_from_the_checkout_when_run_from_elsewhere(engine_venv: Path, tmp_path: Path):
    found = ep.find_engine_python(env={}, cwd=tmp_path, root=engine_venv)
    assert found == str(engine_venv / ".venv-engine" / "bin" / "python")


def test_same_answer_with_or_without_the_makefile_variable(engine_venv: Path, tmp_path: Path):
    """The Makefile exports LORARL_ENGINE_PYTHON=$(abspath .venv-engine)/bin/python."""
    plain = ep.find_engine_python(env={}, cwd=engine_venv, root=tmp_path)
    makefile = str(engine_venv.absolute() / ".venv-engine" / "bin" / "python")
    assert ep.find_engine_python(env={ep.ENV_VAR: makefile}, cwd=tmp_path, root=tmp_path) == plain


def test_a_relative_explicit_path_is_made_absolute_not_resolved(engine_venv, monkeypatch):
    monkeypatch.chdir(engine_venv)
    found = ep.find_engine_python(".venv-engine/bin/python", env={}, cwd=engine_venv)
    assert found == str(engine_venv / ".venv-engine" / "bin" / "python")


def test_missing_says_in_one_line_how_to_build_it(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(ep, "find_spec", lambda name: None)  # this interpreter has no vllm either
    with pytest.raises(ep.EngineInterpreterMissing) as err:
        ep.find_engine_python(env={}, cwd=tmp_path, root=tmp_path)
    message = str(err.value)
    assert "\n" not in message and "`make engine-venv`" in message
    assert "--engine-python" in message and ep.ENV_VAR in message


def test_an_unfinished_engine_venv_is_named(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(ep, "find_spec", lambda name: None)
    python = tmp_path / ".venv-engine" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)  # a venv without vllm (e.g. its build was interrupted)
    with pytest.raises(ep.EngineInterpreterMissing, match="cannot import vllm") as err:
        ep.find_engine_python(env={}, cwd=tmp_path, root=tmp_path)
    assert str(python) in str(err.value)


def test_a_named_interpreter_without_the_engine_fails_instead_of_falling_back(engine_venv):
    with pytest.raises(ep.EngineInterpreterMissing, match=f"{ep.ENV_VAR}=.* cannot import vllm"):
        ep.find_engine_python(env={ep.ENV_VAR: sys.executable}, cwd=engine_venv)


def test_this_interpreter_when_it_has_the_engine(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(ep, "find_spec", lambda name: object())
    assert ep.find_engine_python(env={}, cwd=tmp_path, root=tmp_path) == sys.executable


def test_the_checkout_is_found_from_the_package():
    root = ep.checkout_root()
    assert root is not None and (root / "src" / "lorarl" / "__init__.py").is_file()
    assert not os.path.islink(root)
