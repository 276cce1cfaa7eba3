"""The on-disk record of a local run, so a finished run stays viewable after its trainer exits.

Layout (the trainer writes it; the status API reads it):

    runs/<job>/progress.json   the latest `Progress` as wire JSON (camelCase), rewritten
                               atomically (temp file + rename) after every step and at the end.
    runs/<job>/history.jsonl   one `StepRecord` per line (camelCase), appended after each step.

Readers tolerate a torn last line (a crash mid-append) and repeated steps (a restart from a
checkpoint re-logs the steps after it; the newest record of a step wins).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lorarl.api.reports.progress import Progress, StepRecord

PROGRESS_FILE = "progress.json"
HISTORY_FILE = "history.jsonl"


class RunFilesError(ValueError):
    """A run directory is missing its files or holds unreadable ones."""


def run_dir_of(path: str | os.PathLike[str]) -> Path:
    """The run directory given either the directory itself or its history.jsonl."""
    p = Path(path)
    return p.parent if p.name == HISTORY_FILE else p


def write_progress(run_dir: str | os.PathLike[str], progress: Progress) -> None:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{PROGRESS_FILE}.tmp"
    tmp.write_text(json.dumps(progress.wire()))
    os.replace(tmp, run_dir / PROGRESS_FILE)


def append_history(run_dir: str | os.PathLike[str], record: StepRecord) -> None:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / HISTORY_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record.wire()) + "\n")


def read_progress(run_dir: str | os.PathLike[str]) -> Progress:
    path = Path(run_dir) / PROGRESS_FILE
    try:
        return Progress.model_validate_json(path.read_bytes())
    except FileNotFoundError as exc:
        raise RunFilesError(f"{path}: no such file (is this a lorarl run directory?)") from exc
    except ValueError as exc:
        raise RunFilesError(f"{path}: not a valid progress record: {exc}") from exc


def read_history(run_dir: str | os.PathLike[str]) -> list[StepRecord]:
    path = Path(run_dir) / HISTORY_FILE
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(StepRecord.model_validate_json(line))
        except ValueError as exc:
            if number == len(lines):  # torn final append
                break
            raise RunFilesError(f"{path}:{number}: not a valid step record: {exc}") from exc
    return records


def write_history(run_dir: str | os.PathLike[str], records: list[StepRecord]) -> None:
    """Replace the history atomically (a resumed run drops the steps it will redo)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{HISTORY_FILE}.tmp"
    tmp.write_text("".join(json.dumps(r.wire()) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, run_dir / HISTORY_FILE)
