"""The trainer's GET /metrics: Prometheus text that a real parser reads, gauges that follow the
rollout backlog live and hold the last step's mean, and no gauge before it is measured."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lorarl.api.reports.progress import StepRecord
from lorarl.trainer.telemetry.metrics import CONTENT_TYPE, GAUGES, EngineLoad, backlog
from lorarl.trainer.telemetry.progress import ProgressServer, ProgressTracker

A, B = "http://rollout-0:8000", "http://rollout-1:8000"


def scrape(base: str) -> dict[str, tuple[dict[str, str], float]]:
    """name -> (labels, value) of every sample, through prometheus_client's own parser."""
    reply = httpx.get(f"{base}/metrics")
    assert reply.status_code == 200
    assert reply.headers["content-type"] == CONTENT_TYPE
    out = {}
    for family in text_string_to_metric_families(reply.text):
        assert family.type == "gauge" and family.documentation == GAUGES[family.name]
        for sample in family.samples:
            assert sample.name not in out
            out[sample.name] = (sample.labels, sample.value)
    return out


class Stats:
    """What RolloutClient.endpoint_stats() returns, set by the test."""

    def __init__(self) -> None:
        self.now = {u: {"requests": 0, "failures": 0, "outstanding": 0} for u in (A, B)}

    def __call__(self) -> dict[str, dict[str, int]]:
        return {u: dict(s) for u, s in self.now.items()}

    def set(self, url: str, requests: int, outstanding: int) -> None:
        self.now[url].update(requests=requests, outstanding=outstanding)


def test_backlog_counts_only_busy_engines() -> None:
    stats = Stats()
    assert backlog(stats()) == 0.0
    stats.set(A, 6, 6)
    assert backlog(stats()) == 6.0  # B idle: not serving this generation
    stats.set(B, 2, 2)
    assert backlog(stats()) == 4.0


def test_step_window_is_the_mean_over_the_generation_phase() -> None:
    stats = Stats()
    load = EngineLoad(stats, interval=3600)  # sampled by hand here
    stats.set(A, 4, 4)
    stats.set(B, 4, 4)
    load.sample()  # 4 per engine
    stats.set(A, 4, 1)
    stats.set(B, 4, 1)
    load.sample()  # 1 per engine
    stats.set(A, 4, 0)
    stats.set(B, 4, 0)
    load.sample()  # idle (training): left out of the mean, not averaged in as 0
    assert load.end_step() == (2.5, 2)
    stats.set(A, 10, 3)
    load.sample()
    assert load.end_step() == (3.0, 1)  # only A served this step
    assert load.end_step() == (0.0, 0)


def test_metrics_endpoint_follows_the_run(tmp_path: Path) -> None:
    tracker = ProgressTracker("gsm8k-run", total_steps=5, output_dir=tmp_path)
    server = ProgressServer(tracker, port=0, host="127.0.0.1").start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        first = scrape(base)
        assert first == {"lorarl_trainer_step": ({"job": "gsm8k-run"}, 0.0)}  # nothing made up

        stats = Stats()
        tracker.watch_engines(stats)
        assert tracker.load is not None
        tracker.load.stop()  # the test samples by hand
        stats.set(A, 8, 8)
        stats.set(B, 8, 4)
        live = scrape(base)
        assert live["lorarl_rollout_backlog_per_engine"] == ({"job": "gsm8k-run"}, 6.0)
        tracker.load.sample()
        stats.set(A, 8, 0)
        stats.set(B, 8, 0)
        assert scrape(base)["lorarl_rollout_backlog_per_engine"][1] == 0.0

        tracker.record(
            StepRecord(
                step=1,
                time=1.0,
                reward_mean=0.25,
                generate_seconds=3.5,
                step_seconds=9.0,
                engine_requests={"rollout-0": 8, "rollout-1": 8, "rollout-2": 0},
            ),
            None,
        )
        one = {name: value for name, (_, value) in scrape(base).items()}
        assert one == {
            "lorarl_trainer_step": 1.0,
            "lorarl_reward_mean": 0.25,
            "lorarl_rollout_engines_serving": 2.0,  # the step's own per-replica counts
            "lorarl_rollout_backlog_per_engine": 0.0,
            "lorarl_rollout_backlog_per_engine_last_step": 6.0,
            "lorarl_generate_seconds_last_step": 3.5,
            "lorarl_step_seconds_last_step": 9.0,
        }

        stats.set(A, 9, 1)  # step 2: one request on one engine
        tracker.load.sample()
        tracker.record(StepRecord(step=2, time=2.0, reward_mean=float("nan")), None)
        two = {name: value for name, (_, value) in scrape(base).items()}
        assert two["lorarl_trainer_step"] == 2.0
        assert math.isnan(two["lorarl_reward_mean"])  # a diverged run shows NaN, not a number
        assert two["lorarl_rollout_backlog_per_engine_last_step"] == 1.0
        assert two["lorarl_rollout_engines_serving"] == 1.0  # from the client's counts
        assert "lorarl_step_seconds_last_step" not in two  # not measured: left out
    finally:
        server.stop()


def test_a_restarted_trainer_shows_its_last_step_before_the_next(tmp_path: Path) -> None:
    first = ProgressTracker("job", total_steps=5, output_dir=tmp_path)
    for s in (1, 2, 3):
        first.record(StepRecord(step=s, time=float(s), reward_mean=s / 4, step_seconds=2.0), None)
    again = ProgressTracker("job", total_steps=5, output_dir=tmp_path)
    again.resume(2)
    text = again.metrics_text().decode()
    assert 'lorarl_trainer_step{job="job"} 2\n' in text
    assert 'lorarl_reward_mean{job="job"} 0.5\n' in text
    assert "backlog" not in text  # no rollout client watched yet
