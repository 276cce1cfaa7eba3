"""Response models and the pure conversions behind them."""

from __future__ import annotations

import pytest

from harness.engines.fake_trainer import make_record
from lorarl.api.reports.progress import Progress
from lorarl.api.reports.status import CheckpointStatus, LoRARLJobStatus, StepMetrics, SyncStatus
from lorarl.server import views
from lorarl.server.models import JobMetrics, JobSummary
from tests.unit.server.test_server_local import make_job


def test_summary_wire_is_camel_case() -> None:
    row = JobSummary(
        namespace="a",
        name="b",
        phase="Running",
        step=2,
        total_steps=9,
        reward_mean=0.5,
        last_sync_seconds=0.1,
        age_seconds=3.0,
    )
    assert row.wire() == {
        "namespace": "a",
        "name": "b",
        "phase": "Running",
        "step": 2,
        "totalSteps": 9,
        "rewardMean": 0.5,
        "lastSyncSeconds": 0.1,
        "ageSeconds": 3.0,
    }


def test_metrics_wire_carries_step_records() -> None:
    wire = JobMetrics(namespace="local", name="x", steps=[make_record(1)], live=True).wire()
    assert wire["steps"][0]["rewardMean"] == pytest.approx(0.1)
    assert wire["steps"][0]["syncSeconds"] == pytest.approx(0.21)


def test_status_from_running_progress() -> None:
    latest = make_record(4)
    progress = Progress(
        job="j",
        phase="Running",
        step=4,
        total_steps=8,
        latest=latest,
        last_sync=SyncStatus(version=4, seconds=0.3, mode="adapter"),
        checkpoint=CheckpointStatus(step=2, path="/ckpt/2"),
        started_at=0.0,
        updated_at=60.0,
        message="going",
    )
    status = views.status_from_progress(progress)
    assert (status.phase, status.step, status.total_steps) == ("Running", 4, 8)
    assert status.metrics == StepMetrics(
        reward_mean=0.4,
        reward_std=0.05,
        kl=0.016,
        entropy=0.96,
        tokens_per_second=504.0,
        weight_version=4,
    )
    assert status.last_sync.seconds == 0.3 and status.checkpoint.path == "/ckpt/2"
    assert status.start_time == "1970-01-01T00:00:00Z"
    assert status.completion_time is None
    [cond] = status.conditions
    assert (cond.type, cond.status, cond.message) == ("Running", "True", "going")
    assert cond.last_transition_time == "1970-01-01T00:01:00Z"


def test_status_from_starting_and_failed_progress() -> None:
    starting = views.status_from_progress(Progress(job="j", phase="Starting", total_steps=3))
    assert [(c.type, c.status, c.reason) for c in starting.conditions] == [
        ("Running", "False", "Starting")
    ]
    assert starting.metrics is None
    failed = views.status_from_progress(
        Progress(job="j", phase="Failed", total_steps=3, message="OOM", updated_at=5.0)
    )
    assert [(c.type, c.status, c.message) for c in failed.conditions] == [("Failed", "True", "OOM")]
    assert failed.completion_time == "1970-01-01T00:00:05Z"


def test_job_summary_age_and_missing_status() -> None:
    status = LoRARLJobStatus(
        phase="Running",
        step=1,
        metrics=StepMetrics(reward_mean=0.7),
        last_sync=SyncStatus(seconds=1.5),
    )
    row = views.job_summary("ns", "n", status, created=100.0, now=130.0)
    assert (row.age_seconds, row.reward_mean, row.last_sync_seconds) == (30.0, 0.7, 1.5)
    empty = views.job_summary("ns", "n", None, created=None, now=130.0)
    assert (empty.phase, empty.step, empty.age_seconds) == (None, None, None)


def test_spec_summary() -> None:
    spec = views.spec_summary(make_job(total_steps=12))
    assert spec.wire() == {
        "model": "/models/tiny",
        "algorithm": "rloo",
        "groupSize": 4,
        "loraRank": 8,
        "loraAlpha": 16.0,
        "trainerReplicas": 1,
        "rolloutReplicas": 2,
        "engine": "vllm",
        "syncMode": "merged",
        "totalSteps": 12,
    }


def test_dedupe_keeps_newest_record_per_step_in_order() -> None:
    a, b, c = make_record(1), make_record(2), make_record(3)
    b2 = b.model_copy(update={"reward_mean": -1.0})
    assert views.dedupe_steps([a, b, c, b2]) == [a, b2, c]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2025-01-01T00:00:00Z", 1735689600.0), (None, None), ("", None), ("yesterday", None)],
)
def test_parse_rfc3339(text, expected) -> None:
    assert views.parse_rfc3339(text) == expected
