"""Experiment tracking with the real libraries: TensorBoard event files read back with
TensorBoard's own EventAccumulator, a real `mlflow server` process read back with MlflowClient,
and a W&B offline run parsed from its own record file. Every record goes through the trainer's
real seam (ProgressTracker.record / record_samples / finish)."""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.services.mlflow_server import MlflowServer, mlflow_server_process
from harness.services.wandb_files import wait_wandb_history, wandb_records
from lorarl.api.reports.progress import StepRecord
from lorarl.api.reports.run_files import read_history
from lorarl.api.reports.samples import SAMPLES_FILE, read_sample_rows
from lorarl.api.reports.status import EvalRecord, SourceEval
from lorarl.api.validation import parse_job
from lorarl.local.ports import free_port
from lorarl.trainer.telemetry.progress import ProgressTracker
from lorarl.trainer.telemetry.tracking import IDS_FILE, Fanout, build_fanout

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
STEPS = 3


def _job(logging_spec: dict[str, Any]):
    doc = copy.deepcopy(QUICKSTART)
    doc["spec"]["logging"] = logging_spec
    return parse_job(doc)


def _record(step: int, with_eval: bool = False) -> StepRecord:
    ev = None
    if with_eval:
        ev = EvalRecord(step=step, reward_mean=0.4, accuracy=0.3, pass_at_k={"1": 0.3, "2": 0.5},
                        prompts=8, samples_per_prompt=2, seconds=1.0,
                        by_source={"openai/gsm8k": SourceEval(reward_mean=0.5, accuracy=0.25,
                                                              prompts=4)})  # fmt: skip
    return StepRecord(step=step, time=time.time(), reward_mean=0.1 * step, kl=0.01 * step,
                      loss=-0.5 + step, eval=ev)  # fmt: skip


def _rows(step: int) -> list[dict[str, Any]]:
    return [
        {"step": step, "prompt": f"What is {i}+{step}?", "completion": f"It is {i + step}.",
         "reward": float(i % 2), "advantage": i - 0.5, "finish_reason": "stop"}
        for i in range(2)
    ]  # fmt: skip


def _run(job, output_dir: Path, steps=range(1, STEPS + 1), phase="Succeeded") -> ProgressTracker:
    """What the trainer's rank 0 does: one record per step, samples at step 2, an eval at 3."""
    tracker = ProgressTracker(job.name, STEPS, output_dir)
    tracker.tracking = build_fanout(job, output_dir)
    for step in steps:
        tracker.record(_record(step, with_eval=step == 3), None)
        if step == 2:
            tracker.record_samples(step, _rows(step))
    tracker.finish(phase)
    return tracker


def test_tensorboard_event_files_hold_every_step_eval_and_samples(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(_job({"backends": ["tensorboard"]}), tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    reward = {e.step: e.value for e in acc.Scalars("reward_mean")}
    assert reward == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    assert [e.step for e in acc.Scalars("kl")] == [1, 2, 3]
    assert {e.step: e.value for e in acc.Scalars("eval/accuracy")} == pytest.approx({3: 0.3})
    assert {e.step: e.value for e in acc.Scalars("eval/pass_at_k/2")} == pytest.approx({3: 0.5})
    by_source = acc.Scalars("eval/by_source/openai/gsm8k/accuracy")
    assert {e.step: e.value for e in by_source} == pytest.approx({3: 0.25})
    (text,) = acc.Tensors("samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 2 and "What is 1+2?" in table and "It is 3." in table
    assert [r["prompt"] for r in read_sample_rows(tmp_path)] == ["What is 0+2?", "What is 1+2?"]


def test_an_mlflow_server_that_is_down_warns_and_never_holds_or_fails_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    job = _job({"backends": ["mlflow", "tensorboard"], "mlflow": {"trackingUri": dead}})
    caplog.set_level(logging.WARNING, logger="lorarl.trainer.telemetry.tracking")
    tracker = ProgressTracker(job.name, STEPS, tmp_path)
    tracker.tracking = build_fanout(job, tmp_path)  # imports the libraries: slow on a busy box
    t0 = time.monotonic()
    for step in range(1, STEPS + 1):
        tracker.record(_record(step), None)  # queued: returns at once
    assert time.monotonic() - t0 < 5
    tracker.finish("Succeeded")
    assert [r.step for r in read_history(tmp_path)] == [1, 2, 3]
    warned = [r.getMessage() for r in caplog.records if "mlflow failed" in r.getMessage()]
    assert warned and "history.jsonl" in warned[0], caplog.text
    assert (tmp_path / "tensorboard").is_dir()  # the other tracker carried on


class _Flaky:
    """A sink whose first `fail` calls raise; it records what reaches it."""

    name = "flaky"

    def __init__(self, fail: int, delay: float = 0.0):
        self.fail, self.delay, self.got, self.closed = fail, delay, [], None

    def open(self) -> None:
        pass

    def log_metrics(self, step, metrics) -> None:
        time.sleep(self.delay)
        if self.fail:
            self.fail -= 1
            raise ConnectionError("tracker unreachable")
        self.got.append(step)

    def log_samples(self, step, rows) -> None:
        self.got.append(("samples", step))

    def close(self, failed: bool) -> None:
        self.closed = failed


def test_a_raising_sink_is_skipped_for_a_backoff_then_retried(caplog):
    caplog.set_level(logging.WARNING, logger="lorarl.trainer.telemetry.tracking")
    bad, good = _Flaky(fail=1), _Flaky(fail=0)
    fan = Fanout([bad, good], backoff_s=(2.0, 4.0))
    fan.log_metrics(1, {"a": 1.0})
    fan.log_metrics(2, {"a": 2.0})  # within the backoff: dropped for `bad`
    time.sleep(2.2)
    fan.log_metrics(3, {"a": 3.0})
    fan.log_samples(3, [{"step": 3}])
    fan.close(failed=True)
    assert good.got == [1, 2, 3, ("samples", 3)] and good.closed is True
    assert bad.got == [3, ("samples", 3)] and bad.closed is True
    text = caplog.text
    assert "flaky failed (step 1)" in text and "flaky is back; 2 record(s) were not sent" in text


def test_a_stalled_sink_never_holds_the_caller_and_overflow_is_dropped(caplog):
    caplog.set_level(logging.WARNING, logger="lorarl.trainer.telemetry.tracking")
    slow = _Flaky(fail=0, delay=0.5)
    fan = Fanout([slow], queue_size=2)
    t0 = time.monotonic()
    for step in range(1, 11):
        fan.log_metrics(step, {"a": float(step)})
    assert time.monotonic() - t0 < 2.0  # waiting on the sink would take >= 4 s (8 x 0.5 s)
    assert fan.dropped_full >= 6 and "trackers are behind" in caplog.text
    fan.close()
    assert slow.got[0] == 1 and len(slow.got) == 10 - fan.dropped_full


def test_wandb_offline_run_holds_every_step_eval_and_the_samples_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # no key: offline
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    job = _job({"backends": ["wandb"], "runName": "gsm8k grpo r16", "wandb": {"project": "t"}})
    _run(job, tmp_path)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    run_id = json.loads((tmp_path / IDS_FILE).read_text())["wandb_run_id"]
    (run_file,) = run_dir.glob(f"run-{run_id}.wandb")
    steps = wait_wandb_history(run_file, [1, 2, 3])
    assert sorted(steps) == [1, 2, 3]
    assert [round(steps[s]["reward_mean"], 6) for s in (1, 2, 3)] == [0.1, 0.2, 0.3]
    assert steps[3]["eval/accuracy"] == pytest.approx(0.3)
    assert steps[3]["eval/by_source/openai/gsm8k/accuracy"] == pytest.approx(0.25)
    run = next(r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run")
    assert run.display_name == "gsm8k grpo r16" and run.project == "t"
    assert steps[2]["samples/_type"] == "table-file" and steps[2]["samples/nrows"] == 2
    table = json.loads((run_dir / "files" / steps[2]["samples/path"]).read_text())
    assert table["columns"][:3] == ["step", "prompt", "completion"]
    assert [row[1] for row in table["data"]] == ["What is 0+2?", "What is 1+2?"]
    assert (tmp_path / SAMPLES_FILE).is_file()


@pytest.fixture(scope="module", autouse=True)
def _mlflow_process(request, tmp_path_factory):
    """A real tracking server, started with the module's first test so it boots while the
    others run; only if a test needs it."""
    if not any("mlflow_server" in item.fixturenames for item in request.session.items):
        yield None
        return
    with mlflow_server_process(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


@pytest.fixture
def mlflow_server(_mlflow_process: MlflowServer) -> str:
    try:
        return _mlflow_process.wait_healthy()
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.mark.slow
def test_mlflow_server_receives_metrics_samples_and_a_restart_continues_the_run(
    tmp_path: Path, mlflow_server: str
):
    from mlflow import MlflowClient

    mlflow = {"trackingUri": mlflow_server, "experiment": "tracking-test"}
    job = _job({"backends": ["mlflow"], "runName": "my run", "mlflow": mlflow})
    _run(job, tmp_path)
    client = MlflowClient(mlflow_server)
    run_id = json.loads((tmp_path / IDS_FILE).read_text())["mlflow_run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "my run"
    assert run.data.tags["lorarl.job"] == job.name
    assert client.get_experiment(run.info.experiment_id).name == "tracking-test"
    history = client.get_metric_history(run_id, "reward_mean")
    assert sorted((m.step, round(m.value, 6)) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [m.step for m in client.get_metric_history(run_id, "eval/accuracy")] == [3]
    by_source = client.get_metric_history(run_id, "eval/by_source/openai/gsm8k/accuracy")
    assert [(m.step, m.value) for m in by_source] == [(3, 0.25)]
    (tmp_path / "dl").mkdir()
    got = client.download_artifacts(run_id, "samples/step_00000002.json", str(tmp_path / "dl"))
    table = json.loads(Path(got).read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert [(r["prompt"], r["completion"]) for r in rows] == [
        ("What is 0+2?", "It is 2."),
        ("What is 1+2?", "It is 3."),
    ]
    # A restarted trainer (same output dir) logs into the same run, not a new one.
    _run(job, tmp_path, steps=[4], phase="Failed")
    assert json.loads((tmp_path / IDS_FILE).read_text())["mlflow_run_id"] == run_id
    assert [m.step for m in client.get_metric_history(run_id, "reward_mean")] == [1, 2, 3, 4]
    assert client.get_run(run_id).info.status == "FAILED"
    # A run deleted on the server (or a server that lost it): the next start opens a new run.
    client.delete_run(run_id)
    _run(job, tmp_path, steps=[5])
    new_id = json.loads((tmp_path / IDS_FILE).read_text())["mlflow_run_id"]
    assert new_id != run_id and client.get_run(new_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(new_id, "reward_mean")] == [5]
