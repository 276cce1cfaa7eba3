"""Sample completions on disk and on the wire (`training.samplesInterval`).

`samples.jsonl` in the output dir holds one `SampleRecord` per line (snake_case keys, as the
trackers' tables), appended by the trainer's rank 0; the trainer's `GET /progress/samples` and the
status API's `GET /v1/jobs/{namespace}/{name}/samples` serve the newest of them (camelCase).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from lorarl.api.base import ReportModel

SAMPLES_FILE = "samples.jsonl"
SERVED_SAMPLES = 64  # the newest samples the endpoints return


class SampleRecord(ReportModel):
    step: int = Field(ge=0, description="Step whose batch the sample is from.")
    prompt: str = Field(description="The prompt as the model saw it, decoded (cut when long).")
    completion: str = Field(description="The completion, decoded (cut when long).")
    reward: float = Field(description="Its reward (with any overlong penalty).")
    advantage: float = Field(description="Its advantage in the step's update.")
    finish_reason: str = Field(description="stop or length (cut at maxResponseTokens).")


def append_samples(output_dir: Path, rows: list[dict[str, Any]]) -> None:
    """One write per step: a crash can tear at most the last line (readers skip it)."""
    if not rows:
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    with open(output_dir / SAMPLES_FILE, "a", encoding="utf-8") as f:
        f.write(text)


def read_sample_rows(output_dir: Path) -> list[dict[str, Any]]:
    """The stored rows, oldest first; a torn or foreign line is skipped."""
    path = Path(output_dir) / SAMPLES_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_samples(output_dir: Path, limit: int = SERVED_SAMPLES) -> list[SampleRecord]:
    """The newest `limit` valid records, oldest first."""
    out: list[SampleRecord] = []
    for row in reversed(read_sample_rows(output_dir)):
        if len(out) == limit:
            break
        try:
            out.append(SampleRecord.model_validate(row))
        except ValidationError:
            continue
    return out[::-1]


def trim_samples(output_dir: Path, upto_step: int) -> None:
    """A resumed run redoes the steps after its checkpoint: drop their samples (atomically)."""
    path = output_dir / SAMPLES_FILE
    if not path.exists():
        return
    kept = [r for r in read_sample_rows(output_dir) if _step(r) <= upto_step]
    tmp = output_dir / f".{SAMPLES_FILE}.tmp"
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), "utf-8")
    os.replace(tmp, path)


def _step(row: dict[str, Any]) -> int:
    step = row.get("step")
    return step if isinstance(step, int) else 0
