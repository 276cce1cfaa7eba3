"""The cluster path end to end: seconds from `kubectl apply` to `Succeeded` for the quickstart job
reshaped for a cluster, every pod run by the process kubelet (harness/kubelet/).

    python -m bench.cluster_e2e [--steps 30] [--cases merged adapter]

One cluster (the real control plane, the Helm chart installed with Helm, the operator and status API
as the chart's pods) serves both cases, one after the other: merged sync, then adapter sync. For
each: seconds from apply to Succeeded and to the first recorded step, seconds per step after it,
steps, reward first -> last (and the means of the first 3 and last 10 steps), each pod's timeline
from apply (admitted by the kubelet, Running, Succeeded). Writes bench/results/cluster_e2e.json.
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
from harness.cluster.cluster import cluster
from harness.cluster.jobs import cluster_job, history, prepare_assets, provision, run_job

RESULTS = Path(__file__).resolve().parent / "results" / "cluster_e2e.json"


def one_case(c: Any, case: str, steps: int) -> dict[str, Any]:
    job = cluster_job(f"bench-{case}", training__totalSteps=steps)
    job["spec"]["rollout"]["syncMode"] = case
    run = run_job(c, job, timeout=1800)
    steps = history(c, run.name)
    rewards = [s["rewardMean"] for s in steps]
    status = run.job["status"]
    c.kubectl("delete", "lrj", run.name)
    return {
        "case": case,
        "apply_to_succeeded_s": round(run.seconds, 1),
        # Where the time goes: pods and engines starting until the first step is recorded, then
        # training (generate, reward, update, sync per step).
        "apply_to_first_step_s": round(steps[0]["time"] - run.applied_at, 1),
        "seconds_per_step_after_first": round(
            (steps[-1]["time"] - steps[0]["time"]) / max(1, len(steps) - 1), 2
        ),
        "steps": status["step"],
        "total_steps": steps,
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "reward_first3_mean": round(statistics.mean(rewards[:3]), 4),
        "reward_last10_mean": round(statistics.mean(rewards[-10:]), 4),
        "last_sync_s": status.get("lastSync", {}).get("seconds"),
        # Pod -> event -> seconds after apply (admitted by the kubelet, Running, Succeeded,
        # deleted); pods named by role (trainer-0, rollout-1), the same in every case.
        "pod_timeline_s": {
            pod.removeprefix(f"{run.name}-"): events for pod, events in sorted(run.timeline.items())
        },
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
        "control_plane": c.cp.version,
        "job": "examples/quickstart.yaml on claims: 1 trainer pod x 2 ranks, 2 vLLM rollout pods",
        "cases": cases,
        "notes": "The real control plane (etcd, API server, controller-manager, scheduler) and "
        "the process kubelet as its Node: every pod is a set of local processes (own netns, "
        "read-only root, volumes, Services and NetworkPolicy in nftables); the operator and "
        "status API run as the Helm chart's pods. Engines start cold in each pod (no shared "
        "compile cache), as on fresh nodes. Shared 2-core machine: see the load averages.",
        "machine": {**info, "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
    }
    write_results(RESULTS, report)
    for case in cases:
        print(f"{case['case']}: {case['apply_to_succeeded_s']} s apply -> Succeeded, "
              f"{case['steps']} steps, reward {case['reward_first']:.3f} -> "
              f"{case['reward_last']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
