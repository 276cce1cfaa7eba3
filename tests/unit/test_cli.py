"""The CLI as a user runs it: a real subprocess, real files, real exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lorarl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lorarl.cli", *args], cwd=cwd, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip


def test_validate_good_examples_exits_zero():
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    r = lorarl("validate", *map(str, examples))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": ok") == len(examples) >= 3


def test_validate_bad_examples_prints_each_expected_message():
    bad = sorted((ROOT / "examples" / "bad").glob("*.yaml"))
    r = lorarl("validate", *map(str, bad))
    assert r.returncode == 1
    for path in bad:
        expected = path.read_text().splitlines()[0].removeprefix("# expect: ")
        assert f"{path}: " in r.stderr and expected in r.stderr, path.name


def test_validate_one_bad_among_good_fails():
    r = lorarl("validate", "examples/quickstart.yaml", "examples/bad/rank-zero.yaml")
    assert r.returncode == 1
    assert "spec.lora.rank: must be greater than 0 (got 0)" in r.stderr


def test_validate_missing_file():
    r = lorarl("validate", "examples/nope.yaml")
    assert r.returncode == 1 and "cannot read" in r.stderr


def test_plan_is_byte_identical_across_runs():
    a = lorarl("plan", "examples/qwen2.5-3b-gsm8k.yaml", "-o", "yaml")
    b = lorarl("plan", "examples/qwen2.5-3b-gsm8k.yaml", "-o", "yaml")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and "qwen25-3b-gsm8k-trainer-1" in a.stdout


def test_plan_rejects_a_bad_manifest():
    r = lorarl("plan", "examples/bad/tp-not-dividing-gpus.yaml")
    assert r.returncode == 1 and "tensorParallelSize" in r.stderr


def test_crds_writes_the_committed_file(tmp_path: Path):
    out = tmp_path / "crd.yaml"
    r = lorarl("crds", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_text() == (ROOT / "crds" / "lorarljobs.lorarl.dev.yaml").read_text()
