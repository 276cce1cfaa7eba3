"""`GET /v1/jobs/{namespace}/{name}/samples`: the sample completions of a local run, from the
running trainer's real progress server, then from samples.jsonl once it has stopped."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi.testclient import TestClient

from lorarl.api.reports.progress import StepRecord
from lorarl.api.resource import LoRARLJob
from lorarl.server.app import create_app
from lorarl.server.stores.local import LocalStore
from lorarl.trainer.telemetry.progress import ProgressServer, ProgressTracker

JOB = LoRARLJob.model_validate(
    {
        "metadata": {"name": "demo"},
        "spec": {
            "model": {"path": "/models/tiny"},
            "data": {"trainFiles": ["/data/t.jsonl"]},
            "training": {"totalSteps": 6, "samplesInterval": 2, "samplesPerStep": 2},
        },
    }
)


def _rows(step: int) -> list[dict]:
    return [
        {"step": step, "prompt": f"p{step}-{i}", "completion": f"c{step}-{i}", "reward": float(i),
         "advantage": i - 0.5, "finish_reason": "length" if i else "stop"}
        for i in range(2)
    ]  # fmt: skip


def _step(tracker: ProgressTracker, step: int) -> None:
    tracker.record(StepRecord(step=step, time=time.time(), reward_mean=0.1 * step), None)
    if step % 2 == 0:
        tracker.record_samples(step, _rows(step))


def test_samples_come_live_from_the_trainer_then_from_the_run_files(tmp_path: Path):
    tracker = ProgressTracker("demo", 6, tmp_path)
    server = ProgressServer(tracker, 0, host="127.0.0.1").start()
    store = LocalStore()
    store.add(JOB, f"http://127.0.0.1:{server.port}", run_dir=tmp_path)
    api = TestClient(create_app(store))
    try:
        for step in range(1, 5):
            _step(tracker, step)
        live = api.get("/v1/jobs/local/demo/samples").json()
        assert live["live"] is True
        assert [(s["step"], s["prompt"]) for s in live["samples"]] == [
            (2, "p2-0"), (2, "p2-1"), (4, "p4-0"), (4, "p4-1")
        ]  # fmt: skip
        assert live["samples"][1] == {"step": 2, "prompt": "p2-1", "completion": "c2-1",
                                      "reward": 1.0, "advantage": 0.5,
                                      "finishReason": "length"}  # fmt: skip
        # A restart from the step-2 checkpoint serves (and keeps) only what it still stands on.
        tracker.resume(2)
        again = api.get("/v1/jobs/local/demo/samples").json()
        assert [s["step"] for s in again["samples"]] == [2, 2]
        _step(tracker, 3)
        _step(tracker, 4)
    finally:
        server.stop()
    stopped = api.get("/v1/jobs/local/demo/samples").json()
    assert stopped["live"] is False and "trainer unreachable" in stopped["detail"]
    assert [s["step"] for s in stopped["samples"]] == [2, 2, 4, 4]

    finished = LocalStore()
    finished.add_finished(JOB, tmp_path)
    body = TestClient(create_app(finished)).get("/v1/jobs/local/demo/samples").json()
    assert [s["completion"] for s in body["samples"]] == ["c2-0", "c2-1", "c4-0", "c4-1"]
    assert TestClient(create_app(finished)).get("/v1/jobs/local/nope/samples").status_code == 404


def test_a_run_without_samples_says_how_to_get_them(tmp_path: Path):
    tracker = ProgressTracker("demo", 6, tmp_path)
    _step(tracker, 1)
    store = LocalStore()
    store.add_finished(JOB, tmp_path)
    body = TestClient(create_app(store)).get("/v1/jobs/local/demo/samples").json()
    assert body["samples"] == [] and "training.samplesInterval" in body["detail"]
