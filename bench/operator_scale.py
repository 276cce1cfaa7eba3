"""Operator scale: 200 LoRARLJobs created at once against the Kubernetes API emulator.

    python -m bench.operator_scale [--jobs 200]
    python -m bench.operator_scale --profile /tmp/operator.prof --out /tmp/scale.json  # cProfile

Runs the real operator (`python -m lorarl.operator`, a subprocess) against the emulator, creates
every job as fast as the API takes them, and records for each job the seconds from its create to
the moment all of its children exist (Service, ConfigMap, Secret, NetworkPolicy, 1 trainer + 2
rollout pods). Writes bench/results/operator_scale.json: p50/p95 of those seconds, the p95 of
create -> first child (how long a job waits for the operator to pick it up), the operator's peak
RSS (VmHWM) and its CPU seconds over the run (/proc utime + stime), and the load average at start
and end. The emulator runs in this process and shares the 2 CPU cores. `--profile` runs the
operator under cProfile (several times slower: for finding costs, not for the figures);
`python -m bench.operator_profile scale` does that and prints the top entries. The emulator
stands in for the API server (Go, elsewhere in a cluster); its process gets the operator's
collector settings (GC_THRESHOLDS in lorarl/operator/config.py), so less of its Python overhead
lands on the shared cores.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time
from pathlib import Path

import yaml

from bench.common import cpu_seconds, machine, rss_mb, running_operator, write_results
from lorarl.operator.config import GC_THRESHOLDS
from tests.support.kube.store import Event
from tests.support.kube_emulator import kube_api

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "operator_scale.json"
LRJ = "lorarl.dev/v1alpha1/lorarljobs"
CHILDREN = (
    ("v1/services", ""),
    ("v1/configmaps", "-config"),
    ("v1/secrets", "-engine-key"),
    ("networking.k8s.io/v1/networkpolicies", ""),
)
PODS = ("-trainer-0", "-rollout-0", "-rollout-1")


def _expected(name: str) -> set[tuple[str, str]]:
    return {(res.rsplit("/", 1)[-1], name + sfx) for res, sfx in CHILDREN} | {
        ("pods", name + sfx) for sfx in PODS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--profile", help="write the operator's cProfile stats to this file")
    parser.add_argument("--log", type=Path, help="keep the operator's log here")
    args = parser.parse_args()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    crd = yaml.safe_load((ROOT / "crds" / "lorarljobs.lorarl.dev.yaml").read_text())
    base = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    names = [f"bench-{i:04d}" for i in range(args.jobs)]
    info = machine(note="emulator and operator share the machine's cores")
    with (
        kube_api(crds=[crd]) as kube,
        running_operator(
            kube.kubeconfig_path,
            timer_seconds=30,
            progress_url="http://127.0.0.1:9",
            profile=args.profile,
            log=args.log,
        ) as proc,
    ):
        load = os.getloadavg()[0]
        cpu0, own0 = cpu_seconds(proc.pid), time.process_time()
        seen: dict[tuple[str, str], float] = {}  # (plural, name) -> when it was committed

        def record(event: Event) -> None:  # called by the store on every commit (cheap)
            if event.type == "ADDED":
                seen.setdefault((event.key[1], event.key[3]), time.monotonic())

        kube.emulator.store.hooks.append(record)
        created: dict[str, float] = {}
        t0 = time.monotonic()
        for name in names:
            job = copy.deepcopy(base)
            job["metadata"]["name"] = name
            kube.emulator.create(LRJ, job)
            created[name] = time.monotonic()
        create_s = time.monotonic() - t0
        done: dict[str, float] = {}
        first: dict[str, float] = {}  # create -> its first child: the operator's pick-up
        while len(done) < len(names) and time.monotonic() - t0 < args.timeout:
            for name in names:
                if name not in done and _expected(name) <= seen.keys():
                    done[name] = max(seen[k] for k in _expected(name)) - created[name]
                    first[name] = min(seen[k] for k in _expected(name)) - created[name]
            time.sleep(0.25)
        rss = rss_mb(proc.pid)["VmHWM"]
        cpu = cpu_seconds(proc.pid) - cpu0
        own = time.process_time() - own0
        load_end = os.getloadavg()[0]
        wall = time.monotonic() - t0
    if len(done) < len(names):
        raise SystemExit(f"only {len(done)}/{len(names)} jobs complete within {args.timeout}s")
    secs = sorted(done.values())
    result = {
        "benchmark": "operator_scale",
        "jobs": len(names),
        "p50_s": round(statistics.median(secs), 3),
        "p95_s": round(secs[int(0.95 * (len(secs) - 1))], 3),
        "max_s": round(secs[-1], 3),
        "target_p95_s": 2.0,
        "meets_target_p95": secs[int(0.95 * (len(secs) - 1))] <= 2.0,
        "first_child_p95_s": round(sorted(first.values())[int(0.95 * (len(first) - 1))], 3),
        "peak_rss_mb": rss,
        "operator_cpu_s": round(cpu, 2),
        "operator_cpu_ms_per_job": round(1000 * cpu / len(names), 1),
        "emulator_cpu_s": round(own, 2),  # this process: the API emulator and the poller
        "wall_s": round(wall, 2),
        "create_all_s": round(create_s, 3),
        "children_per_job": len(CHILDREN) + len(PODS),
        "machine": {
            **info,
            "load_avg_1m_at_start": round(load, 2),
            "load_avg_1m_at_end": round(load_end, 2),
        },
    }
    write_results(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
