"""The local console's progress line shows a multi-turn run's turns, tool calls and the share of
the step its environment took; single-turn runs show none of it."""

from __future__ import annotations

from rich.console import Console

from lorarl.api.reports.progress import Progress, StepRecord
from lorarl.local.console import LiveView


def metrics(record: StepRecord) -> str:
    view = LiveView(Console(record=True, width=160), "job", 4)
    view.update(Progress(job="job", phase="Running", step=1, total_steps=4, latest=record))
    return view.progress.tasks[0].fields["metrics"]


def test_the_progress_line_shows_turns_tools_and_the_environment_share():
    record = StepRecord(step=1, time=0.0, reward_mean=0.5, turns_mean=2.25, tool_calls=12.0,
                        tool_errors=3.0, environment_seconds=0.5, step_seconds=4.0)  # fmt: skip
    assert "turns 2.2 · tools 12 (3 failed) · env 12%" in metrics(record)
    quiet = StepRecord(step=1, time=0.0, reward_mean=0.5, turns_mean=2.0, tool_calls=0.0,
                       tool_errors=0.0, environment_seconds=0.0, step_seconds=4.0)  # fmt: skip
    assert "turns 2.0 · tools 0 · env 0%" in metrics(quiet)
    assert "turns" not in metrics(StepRecord(step=1, time=0.0, reward_mean=0.5))
