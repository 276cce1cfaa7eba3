"""Rank 0 leaves its final report as the pod's termination message, so the operator can show the
last step of a finished job (its progress endpoint is gone by then)."""

from __future__ import annotations

from pathlib import Path

from lorarl.api.reports.progress import Progress, StepRecord
from lorarl.operator.status import final_progress
from lorarl.trainer.telemetry.progress import (
    TERMINATION_LIMIT,
    ProgressTracker,
    write_termination_message,
)


def test_finish_writes_a_report_the_operator_reads(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "termination-log"
    log.write_text("")  # the kubelet creates the file; the trainer only fills it
    monkeypatch.setattr("lorarl.trainer.telemetry.progress.TERMINATION_LOG", log)
    tracker = ProgressTracker("quickstart", 3, tmp_path / "out")
    tracker.record(StepRecord(step=3, time=1.0e9, reward_mean=0.75), None)
    tracker.finish("Succeeded", adapter_path="/outputs/quickstart/adapter")
    report = final_progress(log.read_text())
    assert report is not None
    assert (report.phase, report.step, report.total_steps) == ("Succeeded", 3, 3)
    assert report.latest is not None and report.latest.reward_mean == 0.75
    assert report.adapter_path == "/outputs/quickstart/adapter"


def test_nothing_is_created_where_no_kubelet_made_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "termination-log"
    progress = Progress(job="j", phase="Succeeded", step=1, total_steps=1)
    assert write_termination_message(progress, missing) is False
    assert not missing.exists()


def test_a_long_message_is_dropped_to_fit_the_limit(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.write_text("")
    progress = Progress(job="j", phase="Failed", step=1, total_steps=2, message="x" * 10_000)
    assert write_termination_message(progress, log) is True
    text = log.read_text()
    assert len(text.encode()) <= TERMINATION_LIMIT
    assert final_progress(text) is not None
