"""What a person watching `lorarl run --local` sees: a live progress line, then the reward curve."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lorarl.api.reports.progress import Progress as TrainerProgress
from lorarl.api.reports.progress import StepRecord

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARK[int((v - lo) / span * (len(SPARK) - 1))] for v in values)


class LiveView:
    def __init__(self, console: Console, job: str, total_steps: int | None):
        self.progress = Progress(
            TextColumn(f"[bold]{job}[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[metrics]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = self.progress.add_task("train", total=total_steps, metrics="starting engines…")
        self._eval_shown: int | None = None  # step of the last eval printed

    def update(self, p: TrainerProgress | None) -> None:
        if p is None:
            return
        if p.eval is not None and p.eval.step != self._eval_shown:
            self._eval_shown = p.eval.step
            self.progress.console.print(p.eval.line())
        r = p.latest
        metrics = "waiting for the first step…"
        if r is not None:
            parts = [f"reward {r.reward_mean:.3f}"]
            if r.kl is not None:
                parts.append(f"kl {r.kl:.4f}")
            if r.explained_variance is not None:  # ppo: how well the critic predicts returns
                parts.append(f"value loss {r.value_loss:.4f} · ev {r.explained_variance:.2f}")
            if r.turns_mean is not None:  # multi-turn: turns, tools, environment's time share
                parts.append(f"turns {r.turns_mean:.1f} · tools {r.tool_calls or 0:.0f}")
                if r.tool_errors:
                    parts[-1] += f" ({r.tool_errors:.0f} failed)"
                if r.environment_seconds is not None and r.step_seconds:
                    parts.append(f"env {r.environment_seconds / r.step_seconds:.0%}")
            if r.tokens_per_second:
                parts.append(f"{r.tokens_per_second:.0f} tok/s")
            if r.sync_seconds is not None:
                parts.append(f"sync {r.sync_seconds * 1000:.0f} ms")
            if r.cpu_util is not None:  # does any core idle while the step runs?
                parts.append(f"cpu {r.cpu_util:.0%}")
            metrics = " · ".join(parts)
        # the trainer's total: with training.epochs only it knows the count (the spec has none)
        total = p.total_steps or None
        self.progress.update(self.task, completed=p.step, total=total, metrics=metrics)

    def __enter__(self) -> LiveView:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


def summary(
    console: Console,
    history: list[StepRecord],
    progress: TrainerProgress | None = None,
    width: int = 10,
) -> None:
    """The reward curve as a sparkline plus a table of every `width`-th step, then the evals on
    data.valFiles: accuracy over the run, the one before training and the final one."""
    if not history:
        console.print("no steps recorded")
        return
    rewards = [r.reward_mean for r in history]
    console.print(f"reward  {sparkline(rewards)}  {rewards[0]:.3f} → {rewards[-1]:.3f}")
    has_evals = any(r.eval is not None for r in history)
    table = Table("step", "reward", "kl", "step s", "sync ms", *(["eval acc"] if has_evals else []))
    every = max(1, len(history) // width)
    rows = history[::every] + ([history[-1]] if (len(history) - 1) % every else [])
    evaluated = [r for r in history if r.eval is not None]
    if len(evaluated) <= 2 * width:  # every eval gets its row, unless there are too many
        rows = sorted({r.step: r for r in rows + evaluated}.values(), key=lambda r: r.step)
    for r in rows:
        cells = [
            str(r.step),
            f"{r.reward_mean:.3f}",
            "" if r.kl is None else f"{r.kl:.4f}",
            "" if r.step_seconds is None else f"{r.step_seconds:.2f}",
            "" if r.sync_seconds is None else f"{r.sync_seconds * 1000:.0f}",
        ]
        if has_evals:
            cells.append("" if r.eval is None else f"{r.eval.accuracy:.3f}")
        table.add_row(*cells)
    console.print(table)
    baseline = progress.baseline_eval if progress else None
    evals = ([baseline] if baseline else []) + [r.eval for r in history if r.eval is not None]
    if not evals:
        return
    accuracy = [e.accuracy for e in evals]
    console.print(f"eval accuracy  {sparkline(accuracy)}  {accuracy[0]:.3f} → {accuracy[-1]:.3f}")
    if baseline is not None and baseline is not evals[-1]:
        console.print(baseline.line())
    last = evals[-1]
    console.print(("final " if last.step == history[-1].step else "") + last.line())
