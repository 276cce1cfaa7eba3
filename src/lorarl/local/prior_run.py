"""What `lorarl run --local` does with a run folder that already holds a run of the same name.

A run folder keeps its job UID (`job-uid`, runner.py), so the trainer takes the folder's
checkpoints as its own and would continue them: running a job again under the same name would
silently continue the old run (or, before its first checkpoint, overwrite its history). So a
session asks first:

    existing="ask"     (no flag) refuse, naming the run and both flags
    existing="resume"  (--resume) continue it: same UID, newest checkpoint
    existing="fresh"   (--fresh) move the folder aside (runs/<job>.<n>), then start at step 0

with `training.resume` taken into account: `required` continues without a flag (the manifest
asks for it) and refuses when there is nothing to continue; `never` refuses --resume.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lorarl.api.reports import run_files
from lorarl.errors import UserError

__all__ = ["EXISTING_CHOICES", "PriorRun", "find_prior_run", "prepare_run_dir"]

EXISTING_CHOICES = ("ask", "resume", "fresh")


@dataclass(frozen=True)
class PriorRun:
    run_dir: Path
    step: int | None  # from progress.json
    total_steps: int | None
    phase: str | None
    checkpoint_steps: tuple[int, ...]

    def describe(self) -> str:
        """'step 12 of 30', with the phase and newest checkpoint when they add something."""
        parts = []
        if self.step is not None:
            of = f" of {self.total_steps}" if self.total_steps else ""
            parts.append(f"step {self.step}{of}")
        if self.phase in ("Succeeded", "Failed"):
            parts.append(self.phase.lower())
        if self.checkpoint_steps:
            newest = self.checkpoint_steps[-1]
            if newest != self.step:
                parts.append(f"checkpoint at step {newest}")
        else:
            parts.append("no checkpoint yet")
        return ", ".join(parts)


def _checkpoint_steps(run_dir: Path) -> tuple[int, ...]:
    steps = []
    for path in (run_dir / "checkpoints").glob("step-*"):
        suffix = path.name.removeprefix("step-")
        if path.is_dir() and suffix.isdigit():
            steps.append(int(suffix))
    return tuple(sorted(steps))


def find_prior_run(run_dir: Path) -> PriorRun | None:
    """The run the folder holds: one with a checkpoint, or progress past step 0. A folder a
    session made but whose trainer never finished a step holds nothing worth keeping."""
    if not run_dir.is_dir():
        return None
    ckpts = _checkpoint_steps(run_dir)
    try:
        progress = run_files.read_progress(run_dir)
    except run_files.RunFilesError:
        progress = None
    step = progress.step if progress is not None else None
    if not ckpts and not step:
        return None
    return PriorRun(
        run_dir,
        step,
        progress.total_steps if progress is not None else None,
        progress.phase if progress is not None else None,
        ckpts,
    )


def _aside(run_dir: Path) -> Path:
    """runs/<job>.1, .2, ...: the first free name beside the folder."""
    n = 1
    while (dest := run_dir.with_name(f"{run_dir.name}.{n}")).exists():
        n += 1
    return dest


def _is_running(run_dir: Path) -> int | None:
    from lorarl.local.runs import live_pid, read_state

    pid = live_pid(read_state(run_dir))
    return pid if pid != os.getpid() else None


def prepare_run_dir(run_dir: Path, existing: str = "ask", policy: str = "auto") -> str | None:
    """Apply `existing` (EXISTING_CHOICES) and `policy` (training.resume) to the folder before
    a session writes to it; a line for the user when it did something, else None. Raises
    UserError for a run that must not be continued or replaced as asked."""
    if existing not in EXISTING_CHOICES:
        raise ValueError(f"existing must be one of {EXISTING_CHOICES}, got {existing!r}")
    flag = {"resume": "--resume", "fresh": "--fresh"}.get(existing)
    if policy == "never" and existing == "resume":
        raise UserError("--resume contradicts the job's training.resume: never: drop one of them")
    if policy == "required" and existing == "fresh":
        raise UserError("--fresh contradicts the job's training.resume: required: drop one of them")
    prior = find_prior_run(run_dir)
    if prior is not None:
        pid = _is_running(run_dir)
        if pid is not None:
            raise UserError(
                f"{run_dir} holds a run that is still running (pid {pid}, "
                f"{prior.describe()}): stop it first (`lorarl stop {run_dir.name}`)"
            )
    if prior is None:
        if policy == "required" or existing == "resume":
            why = flag or "training.resume: required"
            raise UserError(
                f"{why}: {run_dir} holds no run to continue (no checkpoint and no step done): "
                "check --run-dir or the job's name, or run without it to start at step 0"
            )
        return None
    if existing == "fresh":
        dest = _aside(run_dir)
        run_dir.rename(dest)
        return f"moved the earlier run ({prior.describe()}) aside to {dest}; starting at step 0"
    if existing == "resume" or policy == "required":
        if not prior.checkpoint_steps:
            return (
                f"{run_dir} holds a run ({prior.describe()}) with no checkpoint: it starts "
                "again at step 0"
            )
        return f"continuing the run in {run_dir} ({prior.describe()})"
    if policy == "never":
        raise UserError(
            f"{run_dir} already holds a run ({prior.describe()}) and the job's training.resume "
            f"is never: --fresh to start over (moves it aside to {_aside(run_dir)}), or "
            "--run-dir for another folder"
        )
    raise UserError(
        f"{run_dir} already holds a run ({prior.describe()}); --resume to continue it, "
        f"--fresh to start over (moves it aside to {_aside(run_dir)})"
    )
