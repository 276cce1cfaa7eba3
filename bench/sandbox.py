"""The python_tests sandbox: the in-process audit hook, bubblewrap as first built, and bubblewrap
hardened by issue 34 (unprivileged kernel uid, read-only /proc and /dev, capped /dev/shm, thread
cap, AF_UNIX-only seccomp, a judge that keeps its own builtins and verdict channel).

    python -m bench.sandbox [--runs 30]

Start-up: one `run_python("pass")`. Per-test overhead: a python_tests sample with 1 and with 50
assert tests (stdin/stdout cases cost one start-up each). The two older versions are loaded from
git (`BEFORE`: the commit before the OS sandbox; `BEFORE_ISSUE34`: the last one before issue 34's
hardening) so all three run in this process on the same machine, alternating run by run.
Everything is pinned to one core (children inherit the affinity) and runs one at a time, so
"runs per second" is what one core sustains (on a shared box: see the load recorded with it;
rusage cannot count the sandboxed grandchildren, so there is no CPU-time column).
Writes bench/results/sandbox.json; the figures it replaces are kept there as `previous_record`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import machine, write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "sandbox.json"
BEFORE = "7b22de5"  # the last commit with the audit-hook sandbox
BEFORE_ISSUE34 = "0b59d4d"  # the last commit before issue 34's sandbox and judge hardening
SOLUTION = "def add(a, b):\n    return a + b\n"
MANY = 50
TESTS = [f"assert add({i}, {i + 1}) == {2 * i + 1}" for i in range(MANY)]


def _git_source(path: str, commit: str = BEFORE) -> str:
    return subprocess.run(
        ["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def _load(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    exec(compile(source, name, "exec"), module.__dict__)
    return module


def old_path() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(old run_python, old python_tests) built from git, without registering anything."""
    sandbox = _load("old_sandbox", _git_source("src/lorarl/rewards/sandbox/run.py"))
    source = _git_source("src/lorarl/rewards/functions/code.py")
    source = source.replace(
        "from lorarl.rewards.sandbox.run import SandboxLimits, SandboxResult, run_python",
        "from old_sandbox import SandboxLimits, SandboxResult, run_python",
    ).replace('@register("python_tests", check=_check)\n', "")
    reward = _load("old_code_reward", source)
    return sandbox.run_python, reward.python_tests


def bubblewrap_before_issue34() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(run_python, python_tests) as they were at BEFORE_ISSUE34, under private module names."""
    names = {
        "lorarl.rewards.sandbox.isolation": "i34_isolation",
        "lorarl.rewards.sandbox.run": "i34_sandbox",
        "lorarl.rewards.functions.assert_judge": "i34_assert_judge",
    }

    def source(path: str) -> str:
        text = _git_source(path, BEFORE_ISSUE34)
        for real, private in names.items():
            text = text.replace(f"from {real} import", f"from {private} import")
        return text.replace('@register("python_tests", check=_check)\n', "")

    _load("i34_isolation", source("src/lorarl/rewards/sandbox/isolation.py"))
    sandbox = _load("i34_sandbox", source("src/lorarl/rewards/sandbox/run.py"))
    _load("i34_assert_judge", source("src/lorarl/rewards/functions/assert_judge.py"))
    reward = _load("i34_code_reward", source("src/lorarl/rewards/functions/code.py"))
    return sandbox.run_python, reward.python_tests


def new_path() -> tuple[Callable[..., Any], Callable[..., Any]]:
    from lorarl.rewards.functions.code import python_tests
    from lorarl.rewards.sandbox.run import run_python

    return run_python, python_tests


def cases(run_python: Callable[..., Any], reward: Callable[..., Any]) -> dict[str, Callable]:
    def sample(n: int) -> Callable[[], None]:
        truth = json.dumps(TESTS[:n])

        def go() -> None:
            result = reward("", SOLUTION, truth, {})
            assert result.score == 1.0, result.info

        return go

    def start() -> None:
        assert run_python("pass").status == "ok"

    return {"startup": start, "sample_1_test": sample(1), f"sample_{MANY}_tests": sample(MANY)}


def measure(paths: dict[str, dict[str, Callable]], runs: int) -> dict[str, Any]:
    """Alternate the paths run by run, so a load spike on the shared box hits both alike."""
    walls: dict[tuple[str, str], list[float]] = {}
    for fns in paths.values():
        for fn in fns.values():
            fn()  # warm: imports, the seccomp filter, the availability probe
    for _ in range(runs):
        for path, fns in paths.items():
            for case, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                walls.setdefault((path, case), []).append(time.perf_counter() - t0)
    out: dict[str, Any] = {}
    for (path, case), w in walls.items():
        out.setdefault(path, {})[case] = {
            "runs": runs,
            "wall_p50_ms": round(statistics.median(w) * 1000, 1),
            "wall_min_ms": round(min(w) * 1000, 1),
            "runs_per_s_one_core": round(runs / sum(w), 1),
        }
    for o in out.values():
        one, many = o["sample_1_test"], o[f"sample_{MANY}_tests"]
        o["per_extra_test_ms_p50"] = round(
            (many["wall_p50_ms"] - one["wall_p50_ms"]) / (MANY - 1), 2
        )
        o["assert_tests_per_s_one_core"] = round(MANY * many["runs_per_s_one_core"], 1)
    return out


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args(argv)
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    info = machine(pinned_core=core, uptime_at_start=uptime())
    report: dict[str, Any] = {"benchmark": "sandbox", "machine": info}
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    report |= measure(
        {
            "before_audit_hook": cases(*old_path()),
            "bubblewrap_before_issue34": cases(*bubblewrap_before_issue34()),
            "after_issue34": cases(*new_path()),
        },
        args.runs,
    )
    info["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    info["uptime_at_end"] = uptime()

    def ratio(a: str, b: str) -> dict[str, float]:
        out = {}
        for case in ("startup", "sample_1_test", f"sample_{MANY}_tests"):
            out[f"{case}_p50"] = round(
                report[a][case]["wall_p50_ms"] / report[b][case]["wall_p50_ms"], 2
            )
        return out

    report["issue34_over_before"] = ratio("after_issue34", "bubblewrap_before_issue34")
    report["issue34_over_audit_hook"] = ratio("after_issue34", "before_audit_hook")
    if previous:
        # the figures this run replaces (another day's load: compare within one run, not across)
        kept = {k: v for k, v in previous.items() if k not in ("benchmark", "previous_record")}
        report["previous_record"] = {"date": previous.get("machine", {}).get("date"), **kept}
    write_results(RESULTS, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
