"""`python_tests`: run the completion's Python code against test cases; score the pass fraction.

Tests come from `metadata[tests_key]` or else the ground truth (a JSON string or Python test code):
- assert tests: a list of Python snippets (`["assert add(1, 2) == 3", ...]`, MBPP style) or one
  string of test code. The solution runs in one sandbox and the tests in another that calls into
  it over a pipe and judges the asserts itself (`assert_judge.py`), so a solution cannot forge a
  pass: it can only return values. The tests keep their own builtins and see only the solution's
  API: `metadata["entry_point"]` / `metadata["solution_api"]` where the task declares it, else
  every name the solution defines except the builtins' (`declared_api`).
- stdin/stdout tests: `[{"input": "1 2\\n", "output": "3\\n"}, ...]` or `{"inputs": [...],
  "outputs": [...]}` (APPS style). Each case is a separate sandbox run and the comparison happens
  here, outside the sandbox.
Every sandbox is an OS boundary (bubblewrap namespaces, seccomp, rlimits; `isolation.py`); where it
cannot run, the reward raises `SandboxUnavailable` instead of scoring with weaker isolation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lorarl.rewards.functions.assert_judge import judge_asserts
from lorarl.rewards.registry import RewardResult, register
from lorarl.rewards.sandbox.run import SandboxLimits, check_available, run_python

__all__ = ["IOCase", "TestSuite", "declared_api", "extract_code", "load_tests", "python_tests"]

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_MAX_FAILURES_IN_INFO = 3


@dataclass(frozen=True)
class IOCase:
    stdin: str
    stdout: str


@dataclass(frozen=True)
class TestSuite:
    asserts: tuple[str, ...] = ()
    io: tuple[IOCase, ...] = ()

    @property
    def total(self) -> int:
        return len(self.asserts) + len(self.io)


def extract_code(completion: str) -> str:
    """The last fenced code block (python/py/untagged) if there is one, else the whole text."""
    blocks = [m.group(2) for m in _FENCE.finditer(completion)]
    return blocks[-1] if blocks else completion


def load_tests(
    ground_truth: str | None, metadata: Mapping[str, Any], key: str = "tests"
) -> TestSuite:
    """Parse test cases from `metadata[key]`, else from the ground truth; ValueError if none."""
    if metadata.get(key) is not None:
        return _suite(metadata[key], f"metadata[{key!r}]")
    if ground_truth is None or not str(ground_truth).strip():
        raise ValueError(
            f"python_tests needs test cases in metadata[{key!r}] or the ground truth; got neither"
        )
    text = str(ground_truth)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return TestSuite(asserts=(text,))  # plain Python test code
    return _suite(text if isinstance(value, str) else value, "ground truth")


def _suite(value: Any, where: str) -> TestSuite:
    if isinstance(value, str):
        return TestSuite(asserts=(value,))
    if isinstance(value, Mapping) and {"inputs", "outputs"} <= set(value):
        ins, outs = value["inputs"], value["outputs"]
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError(f"{where}: 'inputs' and 'outputs' must be lists of equal length")
        value = [{"input": i, "output": o} for i, o in zip(ins, outs, strict=True)]
    if not isinstance(value, Sequence) or not value:
        raise ValueError(f"{where}: expected a non-empty list of tests, got {_show(value)}")
    strings = [isinstance(t, str) for t in value]
    if all(strings):
        return TestSuite(asserts=tuple(value))
    if any(strings):
        raise ValueError(f"{where}: mixes assert strings and input/output cases; use one kind")
    cases = []
    for i, t in enumerate(value):
        if not isinstance(t, Mapping) or "input" not in t or "output" not in t:
            raise ValueError(f"{where}[{i}]: expected an {{input, output}} mapping, got {_show(t)}")
        cases.append(IOCase(stdin=_text(t["input"]), stdout=_text(t["output"])))
    return TestSuite(io=tuple(cases))


def _text(v: Any) -> str:
    return "\n".join(map(str, v)) + "\n" if isinstance(v, list) else str(v)


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _check(
    timeout_seconds: float = 10.0,
    test_timeout_seconds: float = 4.0,
    memory_mb: int = 512,
    tests_key: str = "tests",
) -> None:
    for name, v in (
        ("timeout_seconds", timeout_seconds),
        ("test_timeout_seconds", test_timeout_seconds),
    ):
        if not isinstance(v, int | float) or not v > 0:
            raise ValueError(f"python_tests: {name} must be a positive number (got {v!r})")
    if not isinstance(memory_mb, int) or memory_mb < 32:
        raise ValueError(f"python_tests: memory_mb must be an integer >= 32 (got {memory_mb!r})")


@register("python_tests", check=_check)
def python_tests(
    prompt: str,
    completion: str,
    ground_truth: str | None,
    metadata: Mapping[str, Any],
    timeout_seconds: float = 10.0,
    test_timeout_seconds: float = 4.0,
    memory_mb: int = 512,
    tests_key: str = "tests",
) -> RewardResult:
    check_available()  # raises SandboxUnavailable, with what to do, where it cannot run
    suite = load_tests(ground_truth, metadata, tests_key)
    code = extract_code(completion)
    limits = SandboxLimits(
        wall_seconds=float(timeout_seconds),
        cpu_seconds=math.ceil(timeout_seconds),
        memory_bytes=int(memory_mb) * 1024 * 1024,
    )
    if suite.asserts:
        api = declared_api(metadata)
        outcome = _run_asserts(code, suite.asserts, limits, float(test_timeout_seconds), api)
    else:
        outcome = _run_io(code, suite.io, limits, float(test_timeout_seconds))
    return _result(outcome, suite.total)


@dataclass
class _Outcome:
    mode: str
    passed: int
    failures: list[dict[str, Any]]
    status: str
    reason: str


def _result(o: _Outcome, total: int) -> RewardResult:
    info: dict[str, Any] = {
        "mode": o.mode,
        "passed": o.passed,
        "total": total,
        "status": o.status,
        "reason": o.reason,
        "failures": o.failures[:_MAX_FAILURES_IN_INFO],
    }
    return RewardResult(o.passed / total, info)


def declared_api(metadata: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The solution's names the task lets its tests use: `metadata["solution_api"]` (a list of
    names) or `metadata["entry_point"]` (HumanEval's field), else None (every name but the
    builtins')."""
    for key in ("solution_api", "entry_point"):
        value = metadata.get(key)
        if value is None:
            continue
        names = [value] if isinstance(value, str) else value
        if (
            not isinstance(names, Sequence)
            or not names
            or not all(isinstance(n, str) and n.isidentifier() for n in names)
        ):
            raise ValueError(
                f"python_tests: metadata[{key!r}] must be a name or a non-empty list of names "
                f"(got {_show(value)})"
            )
        return tuple(names)
    return None


def _run_asserts(
    code: str,
    tests: Sequence[str],
    limits: SandboxLimits,
    per_test: float,
    api: Sequence[str] | None = None,
) -> _Outcome:
    verdict = judge_asserts(code, tests, limits, per_test, api)
    judge = verdict.judge
    failures = []
    for i in range(len(tests)):
        if i not in verdict.errors:
            why = verdict.solution_error or f"not run: {judge.reason}"
            failures.append({"test": i, "error": why})
        elif verdict.errors[i] is not None:
            failures.append({"test": i, "error": verdict.errors[i]})
    passed = len(tests) - len(failures)
    if verdict.solution_error is not None:
        status, reason = "error", f"solution failed: {verdict.solution_error}"
    else:
        status, reason = judge.status, judge.reason
    return _Outcome("assert", passed, failures, status, reason)


def _run_io(code: str, cases: Sequence[IOCase], limits: SandboxLimits, per_test: float) -> _Outcome:
    deadline = time.monotonic() + limits.wall_seconds
    passed, failures = 0, []
    status, reason = "ok", "all cases ran"
    for i, case in enumerate(cases):
        left = deadline - time.monotonic()
        if left <= 0.05:
            failures.append({"test": i, "error": "not run: time budget exhausted"})
            status, reason = "timeout", f"time budget of {limits.wall_seconds:g} s exhausted"
            continue
        case_limits = _with_wall(limits, min(per_test, left))
        run = run_python(code, limits=case_limits, stdin=case.stdin)
        if not run.ok:
            failures.append({"test": i, "error": run.reason})
            status, reason = run.status, run.reason
        elif _normalize(run.stdout) != _normalize(case.stdout):
            failures.append({"test": i, "error": f"wrong output: {_show(run.stdout)}"})
        else:
            passed += 1
    return _Outcome("io", passed, failures, status, reason)


def _with_wall(limits: SandboxLimits, wall: float) -> SandboxLimits:
    return dataclasses.replace(limits, wall_seconds=wall, cpu_seconds=max(1, math.ceil(wall)))


def _normalize(out: str) -> str:
    """Trailing spaces and trailing blank lines don't make an answer wrong."""
    return "\n".join(line.rstrip() for line in out.strip("\n").splitlines()).rstrip("\n")
