"""Reward throughput: `exact_match` in process vs through the Ray Serve reward service.

    python -m bench.reward_service [--requests 200] [--batch 32] [--concurrency 16]

Writes bench/results/reward_service.json: samples/s and per-request p50/p99 latency for the
service with 1 and 2 replicas, next to the in-process rate, plus a description of the machine
(these numbers move with load: the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from lorarl.api.spec.job import RewardServiceSpec
from lorarl.local.ports import free_port
from lorarl.rewards import get_reward, score_batch
from lorarl.rewards.service.auth import authorization_header
from lorarl.rewards.service.serve import APP_NAME, BatchSettings, RewardTarget, build_app

RESULTS = Path(__file__).resolve().parent / "results" / "reward_service.json"


def make_samples(n: int) -> list[dict]:
    return [
        {
            "prompt": f"What is {i} + {i}?",
            "completion": f"The answer is {2 * i}" if i % 3 else "no idea",
            "groundTruth": f"The answer is {2 * i}",
            "metadata": {},
        }
        for i in range(n)
    ]


def bench_in_process(n: int) -> dict:
    reward = get_reward("exact_match")
    samples = make_samples(n)
    start = time.perf_counter()
    results = score_batch(
        reward,
        [s["prompt"] for s in samples],
        [s["completion"] for s in samples],
        [s["groundTruth"] for s in samples],
    )
    seconds = time.perf_counter() - start
    assert len(results) == n
    return {"samples": n, "seconds": round(seconds, 4), "samples_per_s": round(n / seconds)}


async def _drive(url: str, requests: int, batch: int, concurrency: int, key: str) -> dict:
    body = {"samples": make_samples(batch)}
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            queue.get_nowait()
            t0 = time.perf_counter()
            r = await client.post(f"{url}/score", json=body)
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            assert len(r.json()["scores"]) == batch

    limits = httpx.Limits(max_connections=concurrency)
    headers = authorization_header(key)
    async with httpx.AsyncClient(timeout=60, limits=limits, headers=headers) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    latencies.sort()
    return {
        "requests": requests,
        "samples_per_request": batch,
        "concurrency": concurrency,
        "seconds": round(seconds, 3),
        "samples_per_s": round(requests * batch / seconds),
        "requests_per_s": round(requests / seconds, 1),
        "latency_p50_ms": round(1000 * statistics.median(latencies), 1),
        "latency_p99_ms": round(
            1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1
        ),
    }


def _wait_healthy(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"reward service at {url} not healthy after {timeout} s")


def bench_service(replica_counts: list[int], args: argparse.Namespace) -> list[dict]:
    import ray
    from ray import serve

    ray_dir = tempfile.mkdtemp(prefix="lr-bench-ray-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    key = secrets.token_urlsafe(32)
    out = []
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=ray_dir,
        logging_level="WARNING",
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        targets = {"exact_match": RewardTarget("exact_match", "exact_match")}
        for replicas in replica_counts:
            t0 = time.perf_counter()
            spec = RewardServiceSpec(replicas=replicas)
            app = build_app(targets, spec, batch=BatchSettings(), total_cpus=2, api_key=key)
            serve.run(app, name=APP_NAME, route_prefix="/")
            _wait_healthy(url)
            ready_s = time.perf_counter() - t0
            asyncio.run(_drive(url, 20, args.batch, args.concurrency, key))  # warm up
            loaded = asyncio.run(_drive(url, args.requests, args.batch, args.concurrency, key))
            single = asyncio.run(_drive(url, args.requests // 2, 1, 1, key))
            out.append(
                {
                    "replicas": replicas,
                    "deploy_s": round(ready_s, 2),
                    "concurrent_batches": loaded,
                    "sequential_single_samples": single,
                }
            )
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
    return out


def machine() -> dict:
    import ray

    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--batch", type=int, default=32, help="samples per request")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--in-process-samples", type=int, default=50_000)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    report = {
        "benchmark": "reward_service",
        "reward": "exact_match",
        "machine": machine(),
        "in_process": bench_in_process(args.in_process_samples),
        "service": bench_service([1, 2], args),
        "notes": "Service numbers include HTTP, JSON and two hops (Serve proxy -> ingress -> "
        "reward replica); each request carries samples_per_request samples. Ray gets 2 CPUs, "
        "shared by the proxy, the ingress, the replicas and this load generator, so a second "
        "replica adds little here: it pays off when replicas get their own cores or the reward "
        "itself is expensive (sandboxes, reward models).",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
