"""Run every benchmark under bench/, then render bench/results/README.md (`make bench`).

    python -m bench.run_all                          # all of them (~40 min on 2 busy cores)
    python -m bench.run_all --only sync vs_trl       # a subset
    python -m bench.run_all --skip vs_trl

Each benchmark runs as its own `python -m bench.<name>` process (a crash or a leaked thread pool
in one cannot skew the next) and writes its own results/<name>.json with the machine
description. A benchmark whose module is missing is skipped with a note; one that fails does
not stop the others, but makes the exit status non-zero. The table is rendered from whatever
JSON files are present afterwards.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.render import main as render_main

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
BENCHMARKS = (
    "trainer_step", "sync", "reward_service", "operator_scale", "operator_steady", "vs_trl", "demo",
    "quickstart", "cluster_e2e", "sandbox", "mismatch", "ppo_memory", "tools", "chaos",
    "controlplane_versions", "sync_check", "trainer_memory", "memory_plan",
)  # fmt: skip
# Longer than --timeout by design: the chaos matrix is 9 faults x 10 injections (~2 h here).
MIN_TIMEOUT_S = {"chaos": 9000.0}


@dataclass
class Outcome:
    name: str
    status: str  # "ok", "failed (exit N)", "skipped: ..."
    seconds: float = 0.0


def selected(only: list[str] | None, skip: list[str]) -> list[str]:
    unknown = [n for n in (*(only or []), *skip) if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    return [n for n in BENCHMARKS if (only is None or n in only) and n not in skip]


def run_one(name: str, timeout_s: float) -> Outcome:
    if not (BENCH / f"{name}.py").is_file():
        return Outcome(name, f"skipped: bench/{name}.py does not exist")
    print(f"=== bench.{name}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", f"bench.{name}"], cwd=ROOT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Outcome(name, f"failed (over {timeout_s:.0f} s)", time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    return Outcome(name, "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})",
                   seconds)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"from: {', '.join(BENCHMARKS)}")
    p.add_argument("--skip", nargs="+", metavar="NAME", default=[])
    p.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark")
    args = p.parse_args(argv)
    outcomes = [
        run_one(name, max(args.timeout, MIN_TIMEOUT_S.get(name, 0.0)))
        for name in selected(args.only, args.skip)
    ]
    render_main([])
    print("\nbenchmark        status")
    for o in outcomes:
        took = f" ({o.seconds:.0f} s)" if o.seconds else ""
        print(f"{o.name:16s} {o.status}{took}")
    return 1 if any(o.status.startswith("failed") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
