"""Rank 0's experiment trackers (`spec.logging`): every step's metrics and sample tables go to
each configured backend through one fan-out.

The fan-out runs the sinks on its own thread behind a bounded queue, so a slow or dead tracker
never stalls the step loop: a sink that raises is warned about and skipped for a backoff
(doubling, capped), the records in between are dropped for it (history.jsonl and samples.jsonl
keep them), and it is retried after. A full queue drops the newest record the same way.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lorarl.api.resource import LoRARLJob

log = logging.getLogger(__name__)

QUEUE_SIZE = 256
BACKOFF_S = (5.0, 300.0)  # first wait after a failure, cap
CLOSE_TIMEOUT_S = 60.0
IDS_FILE = "tracking.json"  # run ids, so a restarted trainer continues the same tracker runs


class MetricSink(Protocol):
    """One tracker. Called from the fan-out's thread only; any exception is the fan-out's to
    handle. `open` is called before the first record and again after a failure of `open`."""

    name: str

    def open(self) -> None: ...

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self, failed: bool) -> None: ...


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric fields of a record, nested dicts as `a/b`; a step and the wall time are the
    tracker's axes, not metrics (at any depth: an eval's step is its record's)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if key in ("step", "time"):
            continue
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


@dataclass
class _SinkState:
    sink: MetricSink
    opened: bool = False
    retry_at: float = 0.0
    backoff: float = 0.0
    dropped: int = 0


class Fanout:
    """Hands each record to every sink on a background thread; see the module docstring."""

    def __init__(self, sinks: list[MetricSink], queue_size: int = QUEUE_SIZE,
                 backoff_s: tuple[float, float] = BACKOFF_S):  # fmt: skip
        self._states = [_SinkState(s) for s in sinks]
        self._queue: queue.Queue[tuple[str, int, Any] | None] = queue.Queue(queue_size)
        self._backoff = backoff_s
        self._failed_run = False
        self.dropped_full = 0
        self._thread = threading.Thread(target=self._work, name="lorarl-tracking", daemon=True)
        if self._states:
            self._thread.start()

    @property
    def names(self) -> list[str]:
        return [s.sink.name for s in self._states]

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._put(("metrics", step, dict(metrics)))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if rows:
            self._put(("samples", step, list(rows)))

    def close(self, failed: bool = False, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Deliver what is queued (up to `timeout_s`), then close every sink."""
        if not self._thread.is_alive():
            return
        self._failed_run = failed
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("tracking: queue still full after %.0f s; closing without it", timeout_s)
            return
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("tracking: trackers did not finish within %.0f s; leaving them", timeout_s)

    def _put(self, item: tuple[str, int, Any]) -> None:
        if not self._states:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped_full += 1
            if self.dropped_full == 1 or self.dropped_full % 100 == 0:
                log.warning(
                    "tracking: trackers are behind (%d records queued); dropped %d record(s) "
                    "(history.jsonl keeps them)", self._queue.qsize(), self.dropped_full,
                )  # fmt: skip

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            kind, step, payload = item
            for state in self._states:
                self._deliver(state, kind, step, payload)
        for state in self._states:
            if state.opened:
                self._call(state, "close", lambda s: s.close(self._failed_run))

    def _deliver(self, state: _SinkState, kind: str, step: int, payload: Any) -> None:
        if time.monotonic() < state.retry_at:
            state.dropped += 1
            return
        if not state.opened:
            if not self._call(state, "start", lambda s: s.open()):
                state.dropped += 1
                return
            state.opened = True
        if kind == "metrics":
            ok = self._call(state, f"step {step}", lambda s: s.log_metrics(step, payload))
        else:
            what = f"samples of step {step}"
            ok = self._call(state, what, lambda s: s.log_samples(step, payload))
        if not ok:
            state.dropped += 1

    def _call(self, state: _SinkState, what: str, fn) -> bool:
        try:
            fn(state.sink)
        except Exception as exc:  # a tracker's failure is never the run's
            low, high = self._backoff
            state.backoff = min(high, state.backoff * 2 if state.backoff else low)
            state.retry_at = time.monotonic() + state.backoff
            log.warning(
                "tracking: %s failed (%s): %s; skipping it for %.0f s (history.jsonl and "
                "samples.jsonl keep everything)", state.sink.name, what, _one_line(exc),
                state.backoff,
            )  # fmt: skip
            return False
        if state.backoff:
            log.warning(
                "tracking: %s is back; %d record(s) were not sent to it", state.sink.name,
                state.dropped,
            )  # fmt: skip
            state.backoff, state.dropped = 0.0, 0
        return True


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()
    return text[0][:300] if text else type(exc).__name__


class RunIds:
    """Tracker run ids kept in the output dir (atomically), so a restarted trainer appends to
    the same MLflow / W&B run instead of starting a new one."""

    def __init__(self, output_dir: Path):
        self.path = output_dir / IDS_FILE
        self._lock = threading.Lock()

    def get(self, key: str) -> str | None:
        try:
            value = json.loads(self.path.read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None

    def set(self, key: str, value: str) -> None:
        with self._lock:
            try:
                data = json.loads(self.path.read_text())
                data = data if isinstance(data, dict) else {}
            except (OSError, ValueError):
                data = {}
            data[key] = value
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{IDS_FILE}.tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)


def build_fanout(job: LoRARLJob, output_dir: Path) -> Fanout:
    """The spec's trackers; a backend whose library is missing fails the run at start (that
    is a broken image, not an outage)."""
    from lorarl.trainer.telemetry.sinks import make_sink  # imports the tracker libraries

    ids = RunIds(output_dir)
    sinks = [make_sink(b, job, output_dir, ids) for b in job.spec.logging.backends]
    if sinks:
        log.info("tracking to %s", ", ".join(s.name for s in sinks))
    return Fanout(sinks)
