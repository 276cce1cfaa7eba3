"""Rank 0's Prometheus metrics, served as `GET /metrics` on the progress port.

The autoscaling signal is the rollout backlog: generation requests waiting or in flight per
engine that has any. It is sampled from the rollout client while steps run, because a gauge read
only at scrape time is 0 whenever the scrape falls between generations (training, syncing), and
an autoscaler would scale a saturated fleet down. So there are two: the live value, and the mean
over the last step's generation phase (the samples taken while any request was outstanding),
which holds steady for a whole step.

The text exposition format (0.0.4) is written by hand: the trainer image does not carry
prometheus_client for six gauges.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lorarl.api.reports.progress import StepRecord

# What RolloutClient.endpoint_stats() returns: url -> {"requests", "failures", "outstanding"}.
EngineStats = Callable[[], Mapping[str, Mapping[str, int]]]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SAMPLE_SECONDS = 0.2

GAUGES = {
    "lorarl_trainer_step": "Completed RL steps.",
    "lorarl_reward_mean": "Mean reward of the last step.",
    "lorarl_rollout_engines_serving": "Rollout engines that served generation requests in the "
    "last step.",
    "lorarl_rollout_backlog_per_engine": "Generation requests waiting or in flight per busy "
    "rollout engine, now (0 between generations).",
    "lorarl_rollout_backlog_per_engine_last_step": "Mean of lorarl_rollout_backlog_per_engine "
    "over the last step's generation phase (the autoscaling signal).",
    "lorarl_generate_seconds_last_step": "Generation time of the last step.",
    "lorarl_step_seconds_last_step": "Wall time of the last step.",
}


def backlog(stats: Mapping[str, Mapping[str, int]]) -> float:
    """Outstanding requests per engine that has any (0 when none has)."""
    counts = [int(s.get("outstanding", 0)) for s in stats.values()]
    busy = sum(c > 0 for c in counts)
    return sum(c for c in counts if c > 0) / busy if busy else 0.0


class EngineLoad:
    """Samples the rollout client's backlog on a daemon thread; `end_step` closes one step's
    window. Reading the client's integer counters from another thread is safe enough for a
    gauge: a sample may be one request off, never wrong for long."""

    def __init__(self, stats: EngineStats, interval: float = SAMPLE_SECONDS) -> None:
        self._stats, self._interval = stats, interval
        self._lock = threading.Lock()
        self._sum, self._n = 0.0, 0
        self._requests = self._request_counts()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-load", daemon=True)

    def start(self) -> EngineLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def live(self) -> float:
        try:
            return backlog(self._stats())
        except Exception:  # a gauge must never fail the scrape (or the step)
            return 0.0

    def sample(self) -> None:
        value = self.live()
        if value > 0:  # only the generation phase counts toward the step's mean
            with self._lock:
                self._sum += value
                self._n += 1

    def end_step(self) -> tuple[float, int]:
        """(mean backlog per engine over this step's generation, engines whose request count
        grew since the last call) and a fresh window."""
        counts = self._request_counts()
        with self._lock:
            mean = self._sum / self._n if self._n else 0.0
            self._sum, self._n = 0.0, 0
            grew = sum(n > self._requests.get(url, 0) for url, n in counts.items())
            self._requests = counts
        return mean, grew

    def _request_counts(self) -> dict[str, int]:
        try:
            return {url: int(s.get("requests", 0)) for url, s in self._stats().items()}
        except Exception:
            return {}

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()


@dataclass
class LastStep:
    """What the gauges show of the newest step."""

    step: int
    reward_mean: float
    engines_serving: int | None
    backlog_per_engine: float | None
    generate_seconds: float | None
    step_seconds: float | None


def last_step(record: StepRecord, load: EngineLoad | None) -> LastStep:
    mean, grew = load.end_step() if load is not None else (None, None)
    requests = record.engine_requests
    serving = sum(n > 0 for n in requests.values()) if requests is not None else grew
    return LastStep(
        step=record.step,
        reward_mean=record.reward_mean,
        engines_serving=serving,
        backlog_per_engine=mean,
        generate_seconds=record.generate_seconds,
        step_seconds=record.step_seconds,
    )


def render(job: str, step: int, last: LastStep | None, load: EngineLoad | None) -> bytes:
    """The exposition text: every gauge labelled with the job; a gauge with nothing measured
    yet is left out rather than shown as a made-up 0."""
    values: dict[str, float | int | None] = {"lorarl_trainer_step": step}
    if load is not None:
        values["lorarl_rollout_backlog_per_engine"] = load.live()
    if last is not None:
        values |= {
            "lorarl_reward_mean": last.reward_mean,
            "lorarl_rollout_engines_serving": last.engines_serving,
            "lorarl_rollout_backlog_per_engine_last_step": last.backlog_per_engine,
            "lorarl_generate_seconds_last_step": last.generate_seconds,
            "lorarl_step_seconds_last_step": last.step_seconds,
        }
    label = f'{{job="{_escape(job)}"}}'
    lines = []
    for name, help_text in GAUGES.items():
        value = values.get(name)
        if value is None:
            continue
        lines += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} gauge",
            f"{name}{label} {_num(value)}",
        ]
    return ("\n".join(lines) + "\n").encode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
