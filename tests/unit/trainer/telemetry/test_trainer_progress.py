from __future__ import annotations

import json
from pathlib import Path

import httpx

from lorarl.api.reports.progress import Progress, StepRecord
from lorarl.api.reports.status import SyncStatus
from lorarl.trainer.telemetry.progress import ProgressServer, ProgressTracker, read_history


def record(step: int) -> StepRecord:
    return StepRecord(step=step, time=float(step), reward_mean=step / 10)


def test_endpoint_serves_progress_and_every_step(tmp_path: Path):
    tracker = ProgressTracker("job", total_steps=3, output_dir=tmp_path)
    server = ProgressServer(tracker, port=0, host="127.0.0.1").start()
    try:
        for s in (1, 2):
            tracker.record(record(s), SyncStatus(version=s, seconds=0.1, bytes=10, mode="merged"))
        base = f"http://127.0.0.1:{server.port}"
        progress = Progress.model_validate(httpx.get(f"{base}/progress").json())
        assert (progress.phase, progress.step, progress.total_steps) == ("Running", 2, 3)
        assert progress.latest.reward_mean == 0.2 and progress.last_sync.version == 2
        history = httpx.get(f"{base}/progress/history").json()
        assert [h["step"] for h in history] == [1, 2]
        assert httpx.get(f"{base}/nope").status_code == 404
    finally:
        server.stop()


def test_files_survive_the_trainer_and_resume_drops_redone_steps(tmp_path: Path):
    tracker = ProgressTracker("job", total_steps=5, output_dir=tmp_path)
    for s in (1, 2, 3, 4):
        tracker.record(record(s), None)
    tracker.finish("Failed", message="killed")
    on_disk = json.loads((tmp_path / "progress.json").read_text())
    assert on_disk["phase"] == "Failed" and on_disk["step"] == 4
    again = ProgressTracker("job", total_steps=5, output_dir=tmp_path)
    again.resume(upto_step=2)  # the checkpoint was at step 2: steps 3-4 will be redone
    again.record(record(3), None)
    assert [r.step for r in read_history(tmp_path)] == [1, 2, 3]
