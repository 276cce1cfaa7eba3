"""The backlog gauges over a real RolloutClient generating from two real HTTP engine servers (a
tiny transformers model on 127.0.0.1, each answer held back), scraped from a real /metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.engines.hf_engine_server import Controls, create_app, serve_in_thread
from harness.workloads.tiny_models import make_tiny_model
from lorarl.api.reports.progress import StepRecord
from lorarl.trainer.generation.client import RolloutClient, SamplingParams
from lorarl.trainer.telemetry.progress import ProgressServer, ProgressTracker

PROMPTS = 8  # 4 per engine, all in flight at once (the client allows 16 per engine)
DELAY_S = 1.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[str, Controls]]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    running = []
    for _ in range(2):
        app = create_app(model_dir, served_model_name="tiny")
        url, stop = serve_in_thread(app)
        app.state.controls.delay_s = DELAY_S
        running.append((url, app.state.controls, stop))
    yield [(url, controls) for url, controls, _ in running]
    for _, _, stop in running:
        stop()


def gauges(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_backlog_gauges_follow_a_real_generation(servers, tmp_path: Path) -> None:
    urls = [url for url, _ in servers]
    rc = RolloutClient(urls, "vllm", model_name="tiny", timeout_s=30.0)
    tracker = ProgressTracker("live", total_steps=2, output_dir=tmp_path)
    tracker.watch_engines(rc.endpoint_stats)
    server = ProgressServer(tracker, port=0, host="127.0.0.1").start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert gauges(base)["lorarl_rollout_backlog_per_engine"] == 0.0
        prompts = [[1, 10 + i] for i in range(PROMPTS)]
        done = threading.Event()

        def generate() -> None:
            rc.generate(prompts, 1, SamplingParams(max_tokens=2), expected_version=0)
            done.set()

        worker = threading.Thread(target=generate)
        started = time.monotonic()
        worker.start()
        seen = []
        while not done.is_set():
            seen.append(gauges(base)["lorarl_rollout_backlog_per_engine"])
            time.sleep(0.05)
        worker.join()
        generate_s = time.monotonic() - started
        assert max(seen) == PROMPTS / 2  # every request waiting on its engine, split evenly
        assert gauges(base)["lorarl_rollout_backlog_per_engine"] == 0.0  # and gone after

        tracker.record(
            StepRecord(step=1, time=time.time(), reward_mean=0.5, generate_seconds=generate_s),
            None,
        )
        after = gauges(base)
        assert after["lorarl_rollout_engines_serving"] == 2.0
        # sampled every 0.2 s through a ~1 s generation that held 4 per engine (a sample in the
        # few milliseconds the requests take to go out or come back may see fewer)
        assert 3.0 <= after["lorarl_rollout_backlog_per_engine_last_step"] <= PROMPTS / 2
        assert after["lorarl_generate_seconds_last_step"] >= DELAY_S
        assert after["lorarl_trainer_step"] == 1.0
    finally:
        tracker.finish("Succeeded")
        server.stop()
