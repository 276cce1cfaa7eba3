"""Operator at steady state: 1,000 running LoRARLJobs with their progress timers.

    python -m bench.operator_steady [--jobs 1000] [--window 60] [--timer 10]

Runs the real operator (`python -m lorarl.operator`, a subprocess, with a client certificate of
its own) against a real control plane (kube-apiserver, etcd, kube-controller-manager; no
scheduler: nothing runs the pods) and one progress server (a second process, a real HTTP server)
that answers `/progress` for every job, the way each job's trainer rank 0 would. The jobs are
created, their pods are moved to Running through `pods/status` (as a kubelet would), and once
every job shows phase Running and a timer interval has passed, the benchmark measures for
`--window` seconds: the CPU seconds (utime + stime from /proc) of the operator, the API server,
etcd and the controller-manager apart, the operator's RSS, the API requests it sent (from the API
server's audit log, per verb and resource) and the progress polls it made. Each job's trainer
advances a step every `--step-seconds`, so some polls change the status (a patch) and most do not.
Writes bench/results/operator_steady.json. Where the CPU goes: `python -m bench.operator_profile
steady` (cProfile over the whole run, ramp included), or `--py-spy FILE` (py-spy samples of the
measured window only, as collapsed stacks).
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from bench.common import cpu_seconds, machine, rss_mb, running_operator, write_results
from bench.operator_scale import COMPONENTS, LRJ, PODS
from harness.cluster.controlplane import control_plane
from harness.cluster.kube_client import KubeClient
from lorarl.local.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "operator_steady.json"
TARGET_CORES = 0.25  # operator CPU at 1,000 running jobs, on average


def _serve_progress(port: int, step_seconds: float, hits: Any) -> None:
    """Every job's trainer: `GET /<namespace>/<name>/progress` -> a Progress whose step moves on
    every `step_seconds` (the same wire format the trainer serves)."""
    from harness.engines.fake_trainer import make_record

    t0 = time.time()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the trainer's server allows

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            parts = self.path.strip("/").split("/")
            if len(parts) != 3 or parts[2] != "progress":
                self.send_error(404)
                return
            step = 1 + int((time.time() - t0) / step_seconds)
            record = make_record(step).wire()
            record["stepSeconds"] = step_seconds  # each step's wall time, as a trainer reports
            body = {
                "job": parts[1],
                "phase": "Running",
                "step": step,
                "totalSteps": 100_000,
                "latest": record,
                "startedAt": t0,
                "updatedAt": record["time"],
            }
            data = json.dumps(body).encode()
            with hits.get_lock():
                hits.value += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a poll the operator gave up on (its deadline): its next tick asks again

    server = Server(("127.0.0.1", port), Handler)
    server.serve_forever()


OPERATOR_USER = "lorarl-operator-bench"


def _kind(entry: dict[str, Any]) -> str:
    """ "patch lorarljobs/status", "create events", "watch pods": what an audited request was."""
    ref = entry.get("objectRef") or {}
    what = ref.get("resource", entry.get("requestURI", "?"))
    if ref.get("subresource"):
        what += "/" + ref["subresource"]
    return f"{entry['verb']} {what}"


def _operator_requests(audit: Path, since: float, until: float) -> list[dict[str, Any]]:
    """The operator's requests the API server completed in [since, until) (wall-clock)."""
    import datetime as dt

    out = []
    for line in audit.read_text().splitlines():
        if OPERATOR_USER not in line:
            continue
        entry = json.loads(line)
        if entry.get("stage") != "ResponseComplete":
            continue
        stamp = dt.datetime.fromisoformat(entry["requestReceivedTimestamp"].replace("Z", "+00:00"))
        if since <= stamp.timestamp() < until:
            out.append(entry)
    return out


def _wait(what: str, check: Any, timeout: float, proc: Any, log: Path | None) -> float:
    t0 = time.monotonic()
    while not check():
        if proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else "(rerun with --log to keep its log)"
            raise SystemExit(f"the operator exited while waiting for {what}:\n{tail}")
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)
    return time.monotonic() - t0


def _py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling `pid` for `seconds`, without pausing it, as collapsed stacks."""
    spy = Path(sys.executable).parent / "py-spy"
    cmd = [str(spy), "record", "--pid", str(pid), "--duration", str(int(seconds))]
    cmd += ["--format", "raw", "--nonblocking", "--rate", "50", "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured")
    parser.add_argument("--timer", type=float, default=10.0, help="LORARL_TIMER_SECONDS")
    parser.add_argument("--step-seconds", type=float, default=30.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--profile", help="write the operator's cProfile stats to this file")
    parser.add_argument("--log", type=Path, help="keep the operator's log here")
    parser.add_argument("--note", help="what this run changed, kept in the results as `change`")
    parser.add_argument(
        "--py-spy",
        type=Path,
        help="sample the operator with py-spy during the window only (collapsed stacks to this "
        "file; the figures of such a run are not the benchmark's)",
    )
    args = parser.parse_args()
    base = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    names = [f"steady-{i:04d}" for i in range(args.jobs)]
    info = machine(note="control plane, operator and progress server share the machine's cores")

    port = free_port()
    hits = mp.get_context("spawn").Value("q", 0)
    server = mp.get_context("spawn").Process(
        target=_serve_progress, args=(port, args.step_seconds, hits), daemon=True
    )
    server.start()
    try:
        with control_plane(scheduler=False) as cp:
            cp.apply_crds(ROOT / "crds" / "lorarljobs.lorarl.dev.yaml")
            operator_config = cp.user_kubeconfig("operator", OPERATOR_USER, ["system:masters"])
            kube = KubeClient(cp)
            with running_operator(
                operator_config,
                timer_seconds=args.timer,
                progress_url=f"http://127.0.0.1:{port}/{{namespace}}/{{name}}",
                profile=args.profile,
                log=args.log,
            ) as proc:
                log = args.log
                t_create = time.monotonic()
                for name in names:
                    job = copy.deepcopy(base)
                    job["metadata"]["name"] = name
                    reply = kube.http.post(LRJ, json=job)
                    if reply.status_code != 201:
                        raise SystemExit(f"create {name}: {reply.status_code} {reply.text[:300]}")

                def pods_made() -> bool:
                    made = {p["metadata"]["name"] for p in kube.list_objects("v1/pods", "default")}
                    return all(n + sfx in made for n in names for sfx in PODS)

                _wait("every job's pods", pods_made, args.timeout, proc, log)
                with ThreadPoolExecutor(4) as pool:  # the kubelet: every pod starts
                    list(pool.map(lambda pod: kube.set_pod_phase("default", pod, "Running"),
                                  [n + sfx for n in names for sfx in PODS]))  # fmt: skip

                def phases() -> dict[str, str | None]:
                    jobs = kube.list_objects("lorarl.dev/v1alpha1/lorarljobs", "default")
                    return {
                        j["metadata"]["name"]: (j.get("status") or {}).get("phase") for j in jobs
                    }

                def all_running() -> bool:
                    now = phases()
                    return len(now) == len(names) and all(v == "Running" for v in now.values())

                _wait("every job Running", all_running, args.timeout, proc, log)
                ramp_s = time.monotonic() - t_create
                time.sleep(args.timer + 1)  # every job's timer has fired at least once since
                pids = {c: cp.components[c].proc.pid for c in COMPONENTS}  # type: ignore[union-attr]
                load0 = os.getloadavg()[0]
                cpu0 = {"operator": cpu_seconds(proc.pid)}
                cpu0 |= {c: cpu_seconds(pid) for c, pid in pids.items()}
                hits0, wall0 = hits.value, time.time()
                t0 = time.monotonic()
                spy = _py_spy(proc.pid, args.window, args.py_spy) if args.py_spy else None
                time.sleep(args.window)
                window = time.monotonic() - t0
                if spy is not None:
                    spy.wait()
                wall1 = time.time()
                cpu = {"operator": cpu_seconds(proc.pid) - cpu0["operator"]}
                cpu |= {c: cpu_seconds(pid) - cpu0[c] for c, pid in pids.items()}
                polls = hits.value - hits0
                load1 = os.getloadavg()[0]
                rss = rss_mb(proc.pid)
                still_running = sum(v == "Running" for v in phases().values())
                time.sleep(2.0)  # the audit log's buffered writes for the window
                requests = _operator_requests(cp.workdir / "logs" / "audit.log", wall0, wall1)
                version = cp.version
            kube.close()
    finally:
        server.terminate()
    per_min = 60.0 / window
    verbs = collections.Counter(_kind(r) for r in requests)
    result = {
        "benchmark": "operator_steady",
        "api_server": f"kube-apiserver {version} (real; audit log on, Metadata level)",
        "jobs": args.jobs,
        "timer_seconds": args.timer,
        "trainer_step_seconds": args.step_seconds,
        "window_s": round(window, 1),
        "ramp_s": round(ramp_s, 1),
        "jobs_running_at_end": still_running,
        "operator_cpu_s_per_min": round(cpu["operator"] * per_min, 2),
        "operator_cpu_cores_avg": round(cpu["operator"] / window, 3),
        "target_cpu_cores": TARGET_CORES,
        "meets_target_cpu": cpu["operator"] / window <= TARGET_CORES,
        "kube_apiserver_cpu_cores_avg": round(cpu["kube-apiserver"] / window, 3),
        "etcd_cpu_cores_avg": round(cpu["etcd"] / window, 3),
        "controller_manager_cpu_cores_avg": round(cpu["kube-controller-manager"] / window, 3),
        "operator_rss_mb": rss.get("VmRSS"),
        "operator_peak_rss_mb": rss.get("VmHWM"),
        "api_requests_per_min": round(len(requests) * per_min, 1),
        "api_requests_per_job_per_min": round(len(requests) * per_min / args.jobs, 3),
        "api_requests_by_kind_per_min": {
            v: round(n * per_min, 1) for v, n in sorted(verbs.items())
        },
        "progress_polls_per_job_per_min": round(polls * per_min / args.jobs, 2),
        **({"change": args.note} if args.note else {}),
        "machine": {
            **info,
            "load_avg_1m_at_start": round(load0, 2),
            "load_avg_1m_at_end": round(load1, 2),
        },
    }
    write_results(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
