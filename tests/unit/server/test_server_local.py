"""LocalStore against a real HTTP fake trainer, and the on-disk run format."""

from __future__ import annotations

import json

import pytest

from harness.engines.fake_trainer import FakeTrainer, make_record
from lorarl.api.reports import run_files
from lorarl.api.reports.progress import Progress
from lorarl.api.reports.status import SyncStatus
from lorarl.api.resource import LoRARLJob
from lorarl.server.stores import JobNotFound, LocalStore


def make_job(name: str = "demo", total_steps: int = 10) -> LoRARLJob:
    return LoRARLJob.model_validate(
        {
            "metadata": {"name": name},
            "spec": {
                "model": {"path": "/models/tiny", "dtype": "float32"},
                "data": {"trainFiles": ["/data/t.jsonl"]},
                "lora": {"rank": 8, "alpha": 16},
                "algorithm": {"name": "rloo", "groupSize": 4},
                "training": {"totalSteps": total_steps},
                "trainer": {"replicas": 1, "gpusPerReplica": 0},
                "rollout": {
                    "engine": "vllm",
                    "replicas": 2,
                    "gpusPerReplica": 0,
                    "syncMode": "merged",
                },
            },
        }
    )


def write_run(run_dir, steps: int, phase: str = "Succeeded") -> None:
    history = [make_record(s) for s in range(1, steps + 1)]
    for record in history:
        run_files.append_history(run_dir, record)
    run_files.write_progress(
        run_dir,
        Progress(
            job="demo",
            phase=phase,
            step=steps,
            total_steps=steps,
            latest=history[-1],
            started_at=1_700_000_000.0,
            updated_at=history[-1].time,
            adapter_path="/out/final",
            last_sync=SyncStatus(version=steps, seconds=history[-1].sync_seconds, mode="merged"),
        ),
    )


@pytest.fixture
def trainer():
    with FakeTrainer(job="demo", total_steps=10) as t:
        yield t


def test_live_trainer_is_read_over_http(trainer: FakeTrainer) -> None:
    store = LocalStore()
    store.add(make_job(), trainer.url)
    trainer.step(3)

    [row] = store.list_jobs()
    assert (row.namespace, row.name, row.phase, row.step, row.total_steps) == (
        "local",
        "demo",
        "Running",
        3,
        10,
    )
    assert row.reward_mean == pytest.approx(0.3)
    assert row.last_sync_seconds == pytest.approx(0.23)
    assert row.age_seconds is not None and row.age_seconds >= 29

    detail = store.get_job("local", "demo")
    assert detail.live and detail.detail is None and detail.source == "local"
    assert detail.spec is not None
    assert (detail.spec.algorithm, detail.spec.lora_rank, detail.spec.lora_alpha) == ("rloo", 8, 16)
    assert (detail.spec.trainer_replicas, detail.spec.rollout_replicas) == (1, 2)
    assert (detail.spec.engine, detail.spec.sync_mode) == ("vllm", "merged")
    assert detail.status.metrics.kl == pytest.approx(0.009)
    assert [(c.type, c.status) for c in detail.conditions] == [("Running", "True")]

    metrics = store.get_metrics("local", "demo")
    assert metrics.live
    assert [s.step for s in metrics.steps] == [1, 2, 3]
    assert [s.reward_mean for s in metrics.steps] == pytest.approx([0.1, 0.2, 0.3])
    assert "/progress/history" in trainer.requests and "/progress" in trainer.requests


def test_progress_url_may_name_the_endpoint(trainer: FakeTrainer) -> None:
    store = LocalStore()
    store.add(make_job(), trainer.url + "/progress")
    trainer.step(1)
    assert store.get_job("local", "demo").status.step == 1


def test_trainer_gone_serves_last_snapshot(trainer: FakeTrainer) -> None:
    store = LocalStore()
    store.add(make_job(), trainer.url)
    trainer.step(2)
    trainer.finish()
    store.get_job("local", "demo")
    store.get_metrics("local", "demo")
    trainer.stop()

    detail = store.get_job("local", "demo")
    assert not detail.live
    assert detail.status.phase == "Succeeded" and detail.status.step == 2
    assert "trainer unreachable" in detail.detail and "last snapshot" in detail.detail
    metrics = store.get_metrics("local", "demo")
    assert not metrics.live and [s.step for s in metrics.steps] == [1, 2]
    assert "trainer unreachable" in metrics.detail
    assert store.list_jobs()[0].step == 2


def test_trainer_never_seen_is_pending(trainer: FakeTrainer) -> None:
    url = trainer.url
    trainer.stop()
    store = LocalStore()
    store.add(make_job(total_steps=7), url)
    detail = store.get_job("local", "demo")
    assert detail.status.phase == "Pending" and detail.status.total_steps == 7
    assert "no progress seen yet" in detail.detail
    assert store.get_metrics("local", "demo").steps == []


def test_trainer_gone_prefers_run_files(trainer: FakeTrainer, tmp_path) -> None:
    store = LocalStore()
    store.add(make_job(), trainer.url, run_dir=tmp_path)
    trainer.step(1)
    store.get_metrics("local", "demo")
    trainer.stop()
    write_run(tmp_path, steps=4)  # the trainer wrote its final files before exiting

    detail = store.get_job("local", "demo")
    assert detail.status.phase == "Succeeded" and detail.status.step == 4
    assert str(tmp_path) in detail.detail
    assert [s.step for s in store.get_metrics("local", "demo").steps] == [1, 2, 3, 4]


@pytest.mark.parametrize("via_history_file", [False, True])
def test_add_finished_reads_run_dir(tmp_path, via_history_file: bool) -> None:
    write_run(tmp_path, steps=5)
    store = LocalStore()
    path = tmp_path / run_files.HISTORY_FILE if via_history_file else tmp_path
    store.add_finished(make_job(), path)

    detail = store.get_job("local", "demo")
    assert (detail.status.phase, detail.status.step, detail.live) == ("Succeeded", 5, False)
    assert detail.detail is None
    assert detail.status.adapter_path == "/out/final"
    assert detail.status.completion_time == "2023-11-14T22:14:10Z"
    metrics = store.get_metrics("local", "demo")
    assert [s.step for s in metrics.steps] == [1, 2, 3, 4, 5]
    assert metrics.steps[4].sync_seconds == pytest.approx(0.25)


def test_history_dedupes_restarted_steps_and_ignores_torn_tail(tmp_path) -> None:
    write_run(tmp_path, steps=3)
    rerun = make_record(2).model_copy(update={"reward_mean": 9.0})
    run_files.append_history(tmp_path, rerun)
    with open(tmp_path / run_files.HISTORY_FILE, "a") as f:
        f.write('{"step": 4, "time": 1.0, "rewa')  # crash mid-append
    store = LocalStore()
    store.add_finished(make_job(), tmp_path)
    steps = store.get_metrics("local", "demo").steps
    assert [(s.step, s.reward_mean) for s in steps] == [
        (1, pytest.approx(0.1)),
        (2, 9.0),
        (3, pytest.approx(0.3)),
    ]


def test_corrupt_history_line_is_named(tmp_path) -> None:
    write_run(tmp_path, steps=1)
    lines = (tmp_path / run_files.HISTORY_FILE).read_text()
    (tmp_path / run_files.HISTORY_FILE).write_text("not json\n" + lines)
    with pytest.raises(run_files.RunFilesError, match=r"history\.jsonl:1: not a valid step"):
        LocalStore().add_finished(make_job(), tmp_path)


def test_missing_progress_file_is_named(tmp_path) -> None:
    with pytest.raises(run_files.RunFilesError, match=r"progress\.json: no such file"):
        LocalStore().add_finished(make_job(), tmp_path)


def test_progress_file_is_camel_case_wire(tmp_path) -> None:
    write_run(tmp_path, steps=2)
    on_disk = json.loads((tmp_path / run_files.PROGRESS_FILE).read_text())
    assert on_disk["totalSteps"] == 2 and on_disk["latest"]["rewardMean"] == pytest.approx(0.2)
    first = json.loads((tmp_path / run_files.HISTORY_FILE).read_text().splitlines()[0])
    assert first["step"] == 1 and "syncSeconds" in first


def test_unknown_job_and_other_namespace(tmp_path) -> None:
    write_run(tmp_path, steps=1)
    store = LocalStore()
    store.add_finished(make_job(), tmp_path)
    with pytest.raises(JobNotFound, match="LoRARLJob local/nope not found"):
        store.get_job("local", "nope")
    with pytest.raises(JobNotFound, match="LoRARLJob default/demo not found"):
        store.get_metrics("default", "demo")
    assert store.list_jobs(["default"]) == []
    assert [r.name for r in store.list_jobs(["local"])] == ["demo"]
