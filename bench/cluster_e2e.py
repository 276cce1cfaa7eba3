"""The cluster path end to end: seconds from `kubectl apply` to `Succeeded` for the quickstart
job reshaped for a cluster, every pod run by the process kubelet (tests/support/kubelet/).

    python -m bench.cluster_e2e [--steps 30] [--cases merged adapter]

One cluster (API server emulator, Helm chart applied with kubectl, operator and status API as the
chart runs them) serves both cases, one after the other: merged sync, then adapter sync. For each:
seconds from apply to Succeeded, steps, reward first -> last (and the means of the first 3 and
last 10 steps), each pod's seconds from apply to Running. Writes bench/results/cluster_e2e.json.
Needs root (network and mount namespaces) and nftables/iproute2, like the tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, write_results
from tests.support.cluster import cluster
from tests.support.cluster_jobs import cluster_job, history, prepare_assets, provision, run_job

RESULTS = Path(__file__).resolve().parent / "results" / "cluster_e2e.json"


def one_case(c: Any, case: str, steps: int) -> dict[str, Any]:
    job = cluster_job(f"bench-{case}", training__totalSteps=steps)
    job["spec"]["rollout"]["syncMode"] = case
    run = run_job(c, job, timeout=1800)
    rewards = [s["rewardMean"] for s in history(c, run.name)]
    status = run.job["status"]
    c.kubectl("delete", "lrj", run.name)
    return {
        "case": case,
        "apply_to_succeeded_s": round(run.seconds, 1),
        "steps": status["step"],
        "total_steps": steps,
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "reward_first3_mean": round(statistics.mean(rewards[:3]), 4),
        "reward_last10_mean": round(statistics.mean(rewards[-10:]), 4),
        "last_sync_s": status.get("lastSync", {}).get("seconds"),
        "pods_running_s": {k: round(v, 1) for k, v in sorted(run.pods_running_s.items())},
        "pod_timeline_s": run.timeline,
        "status_api_steps_served": len(run.served),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cases", nargs="+", default=["merged", "adapter"],
                        choices=["merged", "adapter"])  # fmt: skip
    args = parser.parse_args(argv)
    prepare_assets()
    info = machine()
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp, cluster(Path(tmp)) as c:
        provision(c)
        cases = [one_case(c, case, args.steps) for case in args.cases]
    report = {
        "benchmark": "cluster_e2e",
        "job": "examples/quickstart.yaml on claims: 1 trainer pod x 2 ranks, 2 vLLM rollout pods",
        "cases": cases,
        "notes": "Every pod is a set of local processes under the process kubelet (own netns, "
        "read-only root, volumes, NetworkPolicy in nftables); operator and status API run as "
        "the Helm chart says. Engines start cold in each pod (no shared compile cache), as on "
        "fresh nodes. Shared 2-core machine: see the load averages.",
        "machine": {**info, "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
    }
    write_results(RESULTS, report)
    for case in cases:
        print(f"{case['case']}: {case['apply_to_succeeded_s']} s apply -> Succeeded, "
              f"{case['steps']} steps, reward {case['reward_first']:.3f} -> "
              f"{case['reward_last']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
