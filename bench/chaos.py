"""The fault matrix of issue #17 on the real control plane with the process kubelet: nine faults
(issue #17's seven, and the API server's and etcd's restarts), each injected N times (default 10)
at seeded random steps into one tiny job per fault (the quickstart on claims, checkpointInterval
3), one job after the other on one cluster.

    python -m bench.chaos [--faults engine_kill scale ...] [--injections 10]

Faults (harness/chaos/run.py FAULTS): engine_kill, rollout_delete (every other one a grace-0
preemption), sidecar_kill, trainer_rank_kill, operator_kill (its pod killed mid-reconcile), scale (2
-> 3 -> 1 -> 2), reward_kill, apiserver_restart, etcd_restart. Per fault: runs (injections),
succeeded, steps_lost_max, trainer_restarts, checkpoints_bad, duplicate_children, engines_on_latest,
reward_continues, seconds_to_recover_p50/p95 (fault -> every expected pod running once, every
sidecar in sync and a new step recorded) and seconds_to_next_step_p50/p95, and the issue's
acceptance verdict. Writes bench/results/chaos.json after every fault (atomically), so a partial
matrix is kept. Needs root (network and mount namespaces), like the cluster tests.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine, write_results
from harness.chaos.figures import acceptance
from harness.chaos.run import FAULTS, run_fault
from harness.cluster.cluster import cluster
from harness.cluster.jobs import prepare_assets, provision

RESULTS = Path(__file__).resolve().parent / "results" / "chaos.json"
CHECKPOINT_INTERVAL = 3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument("--injections", type=int, default=10)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--recover-timeout", type=float, default=400)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--history-dir",
        type=Path,
        default=None,
        help="write each job's step history and injections here (post-mortems)",
    )
    parser.add_argument("--merge", action="store_true",
                        help="keep the other faults' figures already in --out (a matrix run in "
                        "parts); their injection counts must match --injections")  # fmt: skip
    args = parser.parse_args(argv)
    prepare_assets()
    info = machine()
    kept = kept_faults(args.out, args.faults, args.injections) if args.merge else []
    faults: list[dict[str, Any]] = []
    t0 = time.monotonic()
    spent = sum(f.get("seconds", 0) for f in kept)
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp, cluster(Path(tmp)) as c:
        provision(c)
        for name in args.faults:
            result = run_fault(c, FAULTS[name], args.injections, seed=args.seed,
                               checkpoint_interval=CHECKPOINT_INTERVAL,
                               recover_timeout=args.recover_timeout,
                               history_dir=args.history_dir)  # fmt: skip
            result["control_plane"] = c.cp.version  # kept faults may predate the real one
            result["acceptance_problems"] = acceptance(result, CHECKPOINT_INTERVAL)
            result["passed"] = not result["acceptance_problems"]
            faults.append(result)
            print(f"{name}: runs {result['runs']} succeeded {result['succeeded']} "
                  f"{'PASS' if result['passed'] else result['acceptance_problems']}",
                  flush=True)  # fmt: skip
            order = {n: k for k, n in enumerate(FAULTS)}
            merged = sorted(kept + faults, key=lambda f: order[f["fault"]])
            write_results(args.out, report(merged, info, args, time.monotonic() - t0 + spent))


def kept_faults(path: Path, running: list[str], injections: int) -> list[dict[str, Any]]:
    """The figures of faults this run does not redo, from an earlier run at the same count."""
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    if earlier.get("injections_per_fault") != injections:
        raise SystemExit(f"--merge: {path} has injections_per_fault "
                         f"{earlier.get('injections_per_fault')!r}, not {injections}")  # fmt: skip
    return [f for f in earlier["faults"] if f["fault"] not in running]


def report(faults: list[dict[str, Any]], info: dict[str, Any], args: Any, seconds: float) -> dict:
    return {
        "benchmark": "chaos",
        "job": "examples/quickstart.yaml on claims: 1 trainer pod x 2 ranks, 2 vLLM rollout "
        f"pods (reward_kill: 1, adapter sync, a reward service pod), checkpointInterval "
        f"{CHECKPOINT_INTERVAL}, backoffLimit 100, cosine lr schedule (the quickstart's "
        "constant lr swings the KL in jobs this long)",
        "injections_per_fault": args.injections,
        "seed": args.seed,
        "seconds": round(seconds, 1),
        "faults": faults,
        "notes": "seconds_to_recover: fault -> every expected pod running once with all its "
        "containers, every rollout sidecar in sync, and a step past the fault recorded; "
        "seconds_to_next_step: fault -> the first step past every step recorded before it. "
        "Steps lost: steps recorded before the fault and recorded again after it. Duplicates: "
        "two live pods of one role and index, in the API server or on the node, polled every "
        "0.2 s. A fault's control_plane is the Kubernetes release it ran on; a fault without "
        "one was recorded on the home-made API emulator before it was retired (kept by "
        "--merge). Shared 2-core machine: see the load averages.",
        "machine": {**info, "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
    }


if __name__ == "__main__":
    main()
