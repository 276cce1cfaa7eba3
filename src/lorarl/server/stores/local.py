"""Jobs run by `lorarl run --local`: read from the trainer while it runs, from memory or disk after.

Every job lives in the namespace `local`. The trainer's progress endpoint is the truth while it
answers; when it stops answering (the run finished, or crashed) the store serves the run's files
(see `run_files`) if it knows the run directory, else the last snapshot it read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lorarl.api.reports import run_files
from lorarl.api.reports.progress import Progress, StepRecord
from lorarl.api.reports.samples import read_samples
from lorarl.api.reports.status import LoRARLJobStatus
from lorarl.api.resource import LoRARLJob
from lorarl.server import views
from lorarl.server.models import JobDetail, JobMetrics, JobSamples, JobSummary
from lorarl.server.stores.base import JobNotFound
from lorarl.server.stores.progress_client import ProgressClient, TrainerUnreachable

LOCAL_NAMESPACE = "local"


@dataclass
class _Entry:
    job: LoRARLJob
    progress_url: str | None
    run_dir: Path | None
    added_at: float
    progress: Progress | None = None
    history: list[StepRecord] = field(default_factory=list)
    seen_at: float | None = None


@dataclass(frozen=True)
class _Read:
    """What one look at a job produced, and how fresh it is."""

    progress: Progress | None
    live: bool
    detail: str | None


class LocalStore:
    def __init__(
        self, *, client: ProgressClient | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self._client = client or ProgressClient(timeout=1.0)
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def add(
        self, job: LoRARLJob, progress_url: str | None, run_dir: str | Path | None = None
    ) -> None:
        """Register a running job; `progress_url` is the trainer's base URL (or its /progress),
        None to read only its `run_dir`'s files."""
        entry = _Entry(job, progress_url, Path(run_dir) if run_dir else None, self._clock())
        with self._lock:
            self._entries[job.name] = entry

    def add_finished(self, job: LoRARLJob, history_path: str | Path) -> None:
        """Register a finished run from its files: the run directory or its history.jsonl."""
        run_dir = run_files.run_dir_of(history_path)
        progress = run_files.read_progress(run_dir)
        history = run_files.read_history(run_dir)
        entry = _Entry(job, None, run_dir, self._clock(), progress, history, self._clock())
        with self._lock:
            self._entries[job.name] = entry

    def _entry(self, namespace: str, name: str) -> _Entry:
        with self._lock:
            entry = self._entries.get(name) if namespace == LOCAL_NAMESPACE else None
        if entry is None:
            raise JobNotFound(namespace, name)
        return entry

    def _fallback(self, entry: _Entry, why: str | None) -> _Read:
        if entry.run_dir is not None and (entry.run_dir / run_files.PROGRESS_FILE).exists():
            try:
                entry.progress = run_files.read_progress(entry.run_dir)
                entry.history = run_files.read_history(entry.run_dir)
            except run_files.RunFilesError as exc:
                why = f"{why}; {exc}" if why else str(exc)
            else:
                note = f"showing the run's files in {entry.run_dir}"
                return _Read(entry.progress, False, f"{why}; {note}" if why else None)
        if why is None:
            return _Read(entry.progress, False, None)
        if entry.progress is None:
            return _Read(None, False, f"{why}; no progress seen yet")
        seen = views.rfc3339(entry.seen_at)
        return _Read(entry.progress, False, f"{why}; showing the last snapshot from {seen}")

    def _read(self, entry: _Entry) -> _Read:
        if entry.progress_url is None:
            return self._fallback(entry, None)
        try:
            progress = self._client.progress(entry.progress_url)
        except TrainerUnreachable as exc:
            return self._fallback(entry, f"trainer unreachable ({exc})")
        entry.progress, entry.seen_at = progress, self._clock()
        return _Read(progress, True, None)

    def _status(self, entry: _Entry, read: _Read) -> LoRARLJobStatus:
        if read.progress is None:
            return LoRARLJobStatus(phase="Pending", total_steps=entry.job.spec.training.steps)
        return views.status_from_progress(read.progress)

    def _created(self, entry: _Entry, read: _Read) -> float:
        started = read.progress.started_at if read.progress else None
        return started if started is not None else entry.added_at

    def list_jobs(self, namespaces: Sequence[str] | None = None) -> list[JobSummary]:
        if namespaces is not None and LOCAL_NAMESPACE not in namespaces:
            return []
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: e.job.name)
        rows = []
        for entry in entries:
            read = self._read(entry)
            status = self._status(entry, read)
            created = self._created(entry, read)
            rows.append(
                views.job_summary(LOCAL_NAMESPACE, entry.job.name, status, created, self._clock())
            )
        return rows

    def get_job(self, namespace: str, name: str) -> JobDetail:
        entry = self._entry(namespace, name)
        read = self._read(entry)
        status = self._status(entry, read)
        return JobDetail(
            namespace=LOCAL_NAMESPACE,
            name=name,
            source="local",
            spec=views.spec_summary(entry.job),
            status=status,
            conditions=status.conditions,
            live=read.live,
            detail=read.detail,
        )

    def get_metrics(self, namespace: str, name: str) -> JobMetrics:
        entry = self._entry(namespace, name)
        if entry.progress_url is not None:
            try:
                history = self._client.history(entry.progress_url)
            except TrainerUnreachable as exc:
                read = self._fallback(entry, f"trainer unreachable ({exc})")
            else:
                entry.history = history
                return JobMetrics(
                    namespace=LOCAL_NAMESPACE,
                    name=name,
                    steps=views.dedupe_steps(history),
                    live=True,
                )
        else:
            read = self._fallback(entry, None)
        return JobMetrics(
            namespace=LOCAL_NAMESPACE,
            name=name,
            steps=views.dedupe_steps(entry.history),
            live=False,
            detail=read.detail,
        )

    def get_samples(self, namespace: str, name: str) -> JobSamples:
        """From the running trainer, else from samples.jsonl in the run directory."""
        entry = self._entry(namespace, name)
        why = None
        if entry.progress_url is not None:
            try:
                samples = self._client.samples(entry.progress_url)
            except TrainerUnreachable as exc:
                why = f"trainer unreachable ({exc})"
            else:
                return JobSamples(namespace=LOCAL_NAMESPACE, name=name, samples=samples, live=True)
        samples = read_samples(entry.run_dir) if entry.run_dir is not None else []
        if entry.run_dir is None:
            note = "no run directory to read samples.jsonl from"
        elif samples:
            note = f"read from {entry.run_dir}"
        else:
            note = "none stored (training.samplesInterval)"
        detail = f"{why}; {note}" if why else note
        return JobSamples(
            namespace=LOCAL_NAMESPACE, name=name, samples=samples, live=False, detail=detail
        )
