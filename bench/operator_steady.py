"""Operator at steady state: 1,000 running LoRARLJobs with their progress timers.

    python -m bench.operator_steady [--jobs 1000] [--window 60] [--timer 10]

Runs the real operator (`python -m lorarl.operator`, a subprocess) against the Kubernetes API
emulator (this process) and one progress server (a second process, a real HTTP server) that
answers `/progress` for every job, the way each job's trainer rank 0 would. The jobs are
created, their pods are moved to Running (the emulator's kubelet), and once every job shows
phase Running and a timer interval has passed, the benchmark measures for `--window` seconds:
the operator's CPU seconds (utime + stime from /proc), its RSS, the API requests it sent (counted
by the emulator, per verb) and the progress polls it made. Each job's trainer advances a step
every `--step-seconds`, so some polls change the status (a patch) and most do not.
Writes bench/results/operator_steady.json. Where the CPU goes: `python -m bench.operator_profile
steady`.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import multiprocessing as mp
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from bench.common import cpu_seconds, machine, rss_mb, running_operator, write_results
from bench.operator_scale import LRJ, PODS
from lorarl.local.ports import free_port
from tests.support.kube_emulator import kube_api

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "operator_steady.json"
TARGET_CORES = 0.25  # operator CPU at 1,000 running jobs, on average


def _serve_progress(port: int, step_seconds: float, hits: Any) -> None:
    """Every job's trainer: `GET /<namespace>/<name>/progress` -> a Progress whose step moves on
    every `step_seconds` (the same wire format the trainer serves)."""
    from tests.support.fake_trainer import make_record

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


def _kind(request: Any) -> str:
    """ "PATCH lorarljobs/status", "POST events", "GET pods (watch)": what a request was for."""
    parts = [p for p in str(request.url.path).split("/") if p]
    if "namespaces" in parts and len(parts) > parts.index("namespaces") + 2:
        parts = parts[parts.index("namespaces") + 2 :]
    else:
        parts = parts[-1:]
    what = parts[0] + ("/" + parts[2] if len(parts) > 2 else "")
    watch = " (watch)" if "watch=true" in str(request.url.query_string) else ""
    return f"{str(request.method.value).upper()} {what}{watch}"


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
    args = parser.parse_args()
    crd = yaml.safe_load((ROOT / "crds" / "lorarljobs.lorarl.dev.yaml").read_text())
    base = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    names = [f"steady-{i:04d}" for i in range(args.jobs)]
    info = machine(note="emulator, operator and progress server share the machine's cores")

    port = free_port()
    hits = mp.get_context("spawn").Value("q", 0)
    server = mp.get_context("spawn").Process(
        target=_serve_progress, args=(port, args.step_seconds, hits), daemon=True
    )
    server.start()
    try:
        with (
            kube_api(crds=[crd]) as kube,
            running_operator(
                kube.kubeconfig_path,
                timer_seconds=args.timer,
                progress_url=f"http://127.0.0.1:{port}/{{namespace}}/{{name}}",
                profile=args.profile,
                log=args.log,
            ) as proc,
        ):
            emu, log = kube.emulator, args.log
            t_create = time.monotonic()
            for name in names:
                job = copy.deepcopy(base)
                job["metadata"]["name"] = name
                emu.create(LRJ, job)

            def pods_made() -> bool:
                return all(emu.get("v1/pods", "default", n + PODS[-1]) is not None for n in names)

            _wait("every job's pods", pods_made, args.timeout, proc, log)
            for name in names:  # the kubelet: every pod starts
                for sfx in PODS:
                    emu.set_pod_phase("default", name + sfx, "Running")

            def phase(name: str) -> str | None:
                return ((emu.get(LRJ, "default", name) or {}).get("status") or {}).get("phase")

            _wait("every job Running", lambda: all(phase(n) == "Running" for n in names),
                  args.timeout, proc, log)  # fmt: skip
            ramp_s = time.monotonic() - t_create
            time.sleep(args.timer + 1)  # every job's timer has fired at least once since
            load0 = os.getloadavg()[0]
            cpu0, req0, hits0 = cpu_seconds(proc.pid), len(emu._requests), hits.value
            t0 = time.monotonic()
            time.sleep(args.window)
            window = time.monotonic() - t0
            cpu, requests = cpu_seconds(proc.pid) - cpu0, emu._requests[req0:]
            polls = hits.value - hits0
            load1 = os.getloadavg()[0]
            rss = rss_mb(proc.pid)
            still_running = sum(phase(n) == "Running" for n in names)
    finally:
        server.terminate()
    per_min = 60.0 / window
    verbs = collections.Counter(_kind(r) for r in requests)
    result = {
        "benchmark": "operator_steady",
        "jobs": args.jobs,
        "timer_seconds": args.timer,
        "trainer_step_seconds": args.step_seconds,
        "window_s": round(window, 1),
        "ramp_s": round(ramp_s, 1),
        "jobs_running_at_end": still_running,
        "operator_cpu_s_per_min": round(cpu * per_min, 2),
        "operator_cpu_cores_avg": round(cpu / window, 3),
        "target_cpu_cores": TARGET_CORES,
        "meets_target_cpu": cpu / window <= TARGET_CORES,
        "operator_rss_mb": rss.get("VmRSS"),
        "operator_peak_rss_mb": rss.get("VmHWM"),
        "api_requests_per_min": round(len(requests) * per_min, 1),
        "api_requests_per_job_per_min": round(len(requests) * per_min / args.jobs, 3),
        "api_requests_by_kind_per_min": {
            v: round(n * per_min, 1) for v, n in sorted(verbs.items())
        },
        "progress_polls_per_job_per_min": round(polls * per_min / args.jobs, 2),
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
