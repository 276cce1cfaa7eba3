"""Rank 0's progress: `GET /progress`, `GET /progress/history`, `GET /metrics` (Prometheus,
`trainer/telemetry/metrics.py`), one JSON log line per step, and the same on disk (`progress.json`,
`history.jsonl` in the output dir) so a finished run can still be shown. Every step's record
also goes to the job's experiment trackers (`tracking.Fanout`), and
sample completions to `samples.jsonl` and the trackers.

A stdlib HTTP server on purpose: the trainer image should not need a web framework for a few
read-only routes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lorarl.api.reports.progress import Progress, StepRecord
from lorarl.api.reports.run_files import (
    RunFilesError,
    append_history,
    read_history,
    read_progress,
    write_history,
    write_progress,
)
from lorarl.api.reports.samples import (
    SERVED_SAMPLES,
    SampleRecord,
    append_samples,
    read_sample_rows,
    trim_samples,
)
from lorarl.api.reports.status import CheckpointStatus, EvalRecord, SyncStatus
from lorarl.api.resource import LoRARLJob
from lorarl.jsonhttp import JsonHttpServer, RawBody
from lorarl.trainer.telemetry import metrics
from lorarl.trainer.telemetry.tracking import Fanout, build_fanout, flatten

log = logging.getLogger(__name__)

# Kubernetes mounts this file into every container (terminationMessagePath's default) and shows
# what is written there as the container's termination message, at most 4096 bytes.
TERMINATION_LOG = Path("/dev/termination-log")
TERMINATION_LIMIT = 4096


class ProgressTracker:
    """Thread-safe state behind the endpoint; the training loop is the only writer."""

    def __init__(self, job: str, total_steps: int, output_dir: Path):
        self._lock = threading.Lock()
        self.output_dir = output_dir
        self.history: list[StepRecord] = []
        self.tracking: Fanout | None = None  # rank 0's experiment trackers (spec.logging)
        self.samples: list[dict[str, Any]] = []  # the newest sample completions, served
        self.load: metrics.EngineLoad | None = None  # the rollout backlog, once watched
        self.last: metrics.LastStep | None = None  # the newest step, as the gauges show it
        self.progress = Progress(
            job=job, phase="Starting", total_steps=total_steps, started_at=time.time()
        )

    def resume(self, upto_step: int) -> None:
        """Keep the recorded steps a restarted run still stands on (drop those it will redo)."""
        kept = [r for r in read_history(self.output_dir) if r.step <= upto_step]
        trim_samples(self.output_dir, upto_step)
        samples = read_sample_rows(self.output_dir)[-SERVED_SAMPLES:]
        evals = [r.eval for r in kept if r.eval is not None]
        try:  # the eval before training is in no step record: keep the old report's
            baseline = read_progress(self.output_dir).baseline_eval
        except RunFilesError:
            baseline = None
        with self._lock:
            self.history = kept
            self.samples = samples
            self.progress.step = upto_step
            self.progress.skipped_prompts = sum(r.skipped_prompts or 0 for r in kept)
            self.progress.latest = kept[-1] if kept else None
            self.progress.baseline_eval = baseline
            self.progress.eval = evals[-1] if evals else baseline
            self.last = metrics.last_step(kept[-1], None) if kept else None
        self._write_files(rewrite_history=True)

    def watch_engines(self, stats: metrics.EngineStats) -> None:
        """Sample the rollout client's backlog for /metrics (`RolloutClient.endpoint_stats`)."""
        if self.load is None:
            self.load = metrics.EngineLoad(stats).start()

    def metrics_text(self) -> bytes:
        with self._lock:
            step, last = self.progress.step, self.last
        return metrics.render(self.progress.job, step, last, self.load)

    def record(self, record: StepRecord, sync: SyncStatus | None) -> None:
        last = metrics.last_step(record, self.load)  # closes the step's backlog window
        with self._lock:
            self.last = last
            self.history.append(record)
            self.progress.phase = "Running"
            self.progress.step = record.step
            self.progress.skipped_prompts += record.skipped_prompts or 0
            self.progress.latest = record
            self.progress.last_sync = sync
            if record.eval is not None:
                self.progress.eval = record.eval
            self.progress.updated_at = time.time()
        print(json.dumps({"event": "step", **record.wire()}), flush=True)
        self._write_files(append=record)
        if self.tracking is not None:  # queued: a slow tracker never holds the step
            self.tracking.log_metrics(record.step, flatten(record.model_dump(mode="json")))

    def record_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Sample completions: appended to samples.jsonl, and to the trackers as a table."""
        if not rows:
            return
        append_samples(self.output_dir, rows)
        with self._lock:
            self.samples = (self.samples + list(rows))[-SERVED_SAMPLES:]
        if self.tracking is not None:
            self.tracking.log_samples(step, rows)

    def record_eval(self, record: EvalRecord) -> None:
        """The eval before training (later evals ride on their step's record)."""
        with self._lock:
            self.progress.baseline_eval = record
            self.progress.eval = record
            self.progress.updated_at = time.time()
        print(json.dumps({"event": "eval", **record.wire()}), flush=True)
        self._write_files()
        if self.tracking is not None:  # at step 0, as eval/* like the later evals
            self.tracking.log_metrics(0, flatten({"eval": record.model_dump(mode="json")}))

    def set_checkpoint(self, step: int, path: str) -> None:
        with self._lock:
            self.progress.checkpoint = CheckpointStatus(
                step=step, path=path, time=_rfc3339(time.time())
            )
        self._write_files()

    def finish(
        self,
        phase: Literal["Succeeded", "Failed"],
        message: str = "",
        adapter_path: str | None = None,
    ) -> None:
        if self.load is not None:
            self.load.stop()
        with self._lock:
            self.progress.phase = phase
            self.progress.message = message
            self.progress.adapter_path = adapter_path
            self.progress.updated_at = time.time()
            final = self.progress.model_copy(deep=True)
        self._write_files()
        write_termination_message(final)
        if self.tracking is not None:
            self.tracking.close(failed=phase == "Failed")

    def samples_wire(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = list(self.samples)
        return [SampleRecord.model_validate(r).wire() for r in rows]

    def snapshot(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        with self._lock:
            return self.progress.wire(), [r.wire() for r in self.history]

    def _write_files(self, append: StepRecord | None = None, rewrite_history: bool = False) -> None:
        with self._lock:
            progress, history = self.progress.model_copy(deep=True), list(self.history)
        write_progress(self.output_dir, progress)
        if rewrite_history:
            write_history(self.output_dir, history)
        elif append is not None:
            append_history(self.output_dir, append)


def write_termination_message(progress: Progress, path: Path | None = None) -> bool:
    """Leave the final report where the operator can read it after the pod has stopped.

    The progress endpoint dies with the trainer, so steps after the operator's last poll would
    never reach the job's status (docs/architecture.md, "The operator"). Only where the file already
    exists (the kubelet created it): a local run has none and must not create one in /dev. The
    history is left out; if the report is still over the limit, the free-text message goes."""
    path = path or TERMINATION_LOG
    if not path.is_file():
        return False
    text = progress.model_dump_json(by_alias=True, exclude_none=True)
    if len(text.encode()) > TERMINATION_LIMIT:
        short = progress.model_copy(update={"message": ""})
        text = short.model_dump_json(by_alias=True, exclude_none=True)
    if len(text.encode()) > TERMINATION_LIMIT:
        log.warning("final progress (%d bytes) over the termination message limit", len(text))
        return False
    try:
        path.write_text(text)
    except OSError as exc:
        log.warning("could not write the termination message %s: %s", path, exc)
        return False
    return True


class ProgressServer(JsonHttpServer):
    def __init__(self, tracker: ProgressTracker, port: int, host: str = "0.0.0.0"):
        routes = {
            "/progress": lambda: (200, tracker.snapshot()[0]),
            "/progress/history": lambda: (200, tracker.snapshot()[1]),
            "/progress/samples": lambda: (200, tracker.samples_wire()),
            "/healthz": lambda: (200, {"ok": True}),
            # Unauthenticated like the routes above: the job's NetworkPolicy admits the progress
            # port from the job's own pods and the operator's only (docs: autoscaling).
            "/metrics": lambda: (200, RawBody(tracker.metrics_text(), metrics.CONTENT_TYPE)),
        }
        super().__init__(routes, port, host)


@dataclass
class Telemetry:
    """Rank 0's reporting: the tracker (with the job's experiment trackers) and, with a
    progress port, its server."""

    tracker: ProgressTracker
    server: ProgressServer | None

    @classmethod
    def from_job(
        cls,
        job: LoRARLJob,
        output_dir: Path,
        *,
        total_steps: int,
        dropped_prompts: int,
        progress_port: int | None,
    ) -> Telemetry:
        """Built, and the server started, first on rank 0: progress answers while the fleet
        waits for the sidecars to register."""
        tracker = ProgressTracker(job.name, total_steps, output_dir)
        tracker.progress.dropped_prompts = dropped_prompts
        tracker.tracking = build_fanout(job, output_dir)  # spec.logging
        server = None
        if progress_port is not None:
            server = ProgressServer(tracker, progress_port)
            server.start()
        return cls(tracker, server)


def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
