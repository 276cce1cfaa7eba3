"""Operator scale: 200 LoRARLJobs created at once on a real control plane.

    python -m bench.operator_scale [--jobs 200]
    python -m bench.operator_scale --profile /tmp/operator.prof --out /tmp/scale.json  # cProfile

Runs the real operator (`python -m lorarl.operator`, a subprocess) against a real kube-apiserver,
etcd and kube-controller-manager (harness/cluster/controlplane.py; the scheduler is off: nothing
runs the pods), creates every job as fast as the API takes them, and records for each job the
seconds from its create to the moment all of its children exist (Service, ConfigMap, Secret,
NetworkPolicy, 1 trainer + 2 rollout pods), as seen by watches on the API server. Writes
bench/results/operator_scale.json: p50/p95 of those seconds, the p95 of create -> first child
(how long a job waits for the operator to pick it up), the operator's peak RSS (VmHWM), and the
CPU seconds over the run of the operator, the API server, etcd and the controller-manager apart
(/proc utime + stime), with the load average at start and end. Everything shares the 2 cores.
`--profile` runs the operator under cProfile (several times slower: for finding costs, not for
the figures); `python -m bench.operator_profile scale` does that and prints the top entries.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import threading
import time
from pathlib import Path

import httpx
import yaml

from bench.common import cpu_seconds, machine, rss_mb, running_operator, write_results
from harness.cluster.controlplane import ControlPlane, control_plane

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "operator_scale.json"
LRJ = "/apis/lorarl.dev/v1alpha1/namespaces/default/lorarljobs"
CHILDREN = (
    ("v1/services", ""),
    ("v1/configmaps", "-config"),
    ("v1/secrets", "-engine-key"),
    ("networking.k8s.io/v1/networkpolicies", ""),
)
PODS = ("-trainer-0", "-rollout-0", "-rollout-1")
COMPONENTS = ("kube-apiserver", "etcd", "kube-controller-manager")


class Watches:
    """When each object was first seen ADDED, per (plural, name): one watch per kind, each in a
    thread, from the resourceVersion of a list taken before the jobs are created."""

    def __init__(self, cp: ControlPlane, resources: list[str]) -> None:
        self.cp, self.seen, self.lock = cp, {}, threading.Lock()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._watch, args=(r,), daemon=True) for r in resources
        ]
        self.ready = threading.Barrier(len(resources) + 1)

    def __enter__(self) -> Watches:
        for t in self.threads:
            t.start()
        self.ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()

    def _watch(self, resource: str) -> None:
        api_version, plural = resource.rsplit("/", 1)
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        with self.cp.http() as http:
            http.timeout = httpx.Timeout(10, read=None)
            rv = http.get(f"{base}/{plural}", params={"limit": 1}).json()["metadata"][
                "resourceVersion"
            ]
            params = {"watch": "true", "resourceVersion": rv, "allowWatchBookmarks": "false"}
            with http.stream("GET", f"{base}/{plural}", params=params) as reply:
                self.ready.wait(30)
                for line in reply.iter_lines():
                    if self.stop.is_set():
                        return
                    event = json.loads(line)
                    if event["type"] == "ADDED":
                        key = (plural, event["object"]["metadata"]["name"])
                        with self.lock:
                            self.seen.setdefault(key, time.monotonic())


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
    base = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    names = [f"bench-{i:04d}" for i in range(args.jobs)]
    info = machine(note="control plane, operator and this watcher share the machine's cores")
    with control_plane(scheduler=False) as cp:
        cp.apply_crds(ROOT / "crds" / "lorarljobs.lorarl.dev.yaml")
        with (
            running_operator(
                cp.kubeconfig_path,
                timer_seconds=30,
                progress_url="http://127.0.0.1:9",
                profile=args.profile,
                log=args.log,
            ) as proc,
            Watches(cp, [r for r, _ in CHILDREN] + ["v1/pods"]) as watches,
            cp.http() as http,
        ):
            pids = {c: cp.components[c].proc.pid for c in COMPONENTS}  # type: ignore[union-attr]
            load = os.getloadavg()[0]
            cpu0 = {"operator": cpu_seconds(proc.pid)}
            cpu0 |= {c: cpu_seconds(pid) for c, pid in pids.items()}
            created: dict[str, float] = {}
            t0 = time.monotonic()
            for name in names:
                job = copy.deepcopy(base)
                job["metadata"]["name"] = name
                reply = http.post(LRJ, json=job)
                if reply.status_code != 201:
                    raise SystemExit(f"create {name}: {reply.status_code} {reply.text[:300]}")
                created[name] = time.monotonic()
            create_s = time.monotonic() - t0
            done: dict[str, float] = {}
            first: dict[str, float] = {}  # create -> its first child: the operator's pick-up
            while len(done) < len(names) and time.monotonic() - t0 < args.timeout:
                with watches.lock:
                    seen = dict(watches.seen)
                for name in names:
                    if name not in done and _expected(name) <= seen.keys():
                        done[name] = max(seen[k] for k in _expected(name)) - created[name]
                        first[name] = min(seen[k] for k in _expected(name)) - created[name]
                time.sleep(0.25)
            wall = time.monotonic() - t0
            rss = rss_mb(proc.pid)["VmHWM"]
            cpu = {"operator": cpu_seconds(proc.pid) - cpu0["operator"]}
            cpu |= {c: cpu_seconds(pid) - cpu0[c] for c, pid in pids.items()}
            load_end = os.getloadavg()[0]
    if len(done) < len(names):
        raise SystemExit(f"only {len(done)}/{len(names)} jobs complete within {args.timeout}s")
    secs = sorted(done.values())
    result = {
        "benchmark": "operator_scale",
        "api_server": f"kube-apiserver {cp.version} (real, etcd and controller-manager beside)",
        "jobs": len(names),
        "p50_s": round(statistics.median(secs), 3),
        "p95_s": round(secs[int(0.95 * (len(secs) - 1))], 3),
        "max_s": round(secs[-1], 3),
        "target_p95_s": 2.0,
        "meets_target_p95": secs[int(0.95 * (len(secs) - 1))] <= 2.0,
        "first_child_p95_s": round(sorted(first.values())[int(0.95 * (len(first) - 1))], 3),
        "peak_rss_mb": rss,
        "operator_cpu_s": round(cpu["operator"], 2),
        "operator_cpu_ms_per_job": round(1000 * cpu["operator"] / len(names), 1),
        "kube_apiserver_cpu_s": round(cpu["kube-apiserver"], 2),
        "etcd_cpu_s": round(cpu["etcd"], 2),
        "controller_manager_cpu_s": round(cpu["kube-controller-manager"], 2),
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
