"""Sample completions (`training.samplesInterval`): every N steps rank 0 keeps a few prompts with
their completions, rewards and advantages, in outputDir/samples.jsonl (one JSON object per
sample) and in the trackers' tables. Texts are cut to a bounded length so the file stays small."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lorarl.api.spec import TrainingSpec
from lorarl.trainer.batch import TrainSample

SAMPLES_FILE = "samples.jsonl"
TEXT_LIMIT = 2000  # characters of prompt or completion kept per sample


def due(step: int, training: TrainingSpec) -> bool:
    n = training.samples_interval
    return n > 0 and step % n == 0


def clip(text: str, limit: int = TEXT_LIMIT) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"... [{len(text) - limit} more characters]"


def sample_rows(
    step: int, samples: list[TrainSample], tokenizer: Any, count: int
) -> list[dict[str, Any]]:
    """`count` samples spread evenly over the batch (so over its prompts' groups), decoded."""
    if not samples or count <= 0:
        return []
    n = min(count, len(samples))
    picked = [samples[i * len(samples) // n] for i in range(n)]
    return [
        {
            "step": step,
            "prompt": clip(tokenizer.decode(s.prompt_ids, skip_special_tokens=True)),
            "completion": clip(tokenizer.decode(s.completion_ids, skip_special_tokens=True)),
            "reward": float(s.reward),
            "advantage": float(s.advantage),
            "finish_reason": s.finish_reason,
        }
        for s in picked
    ]


def append_samples(output_dir: Path, rows: list[dict[str, Any]]) -> None:
    """One write per step: a crash can tear at most the last line (readers skip it)."""
    if not rows:
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    with open(output_dir / SAMPLES_FILE, "a", encoding="utf-8") as f:
        f.write(text)


def read_samples(output_dir: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The stored samples, oldest first (the last `limit` if given); a torn line is skipped."""
    path = output_dir / SAMPLES_FILE
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
    return rows[-limit:] if limit else rows


def trim_samples(output_dir: Path, upto_step: int) -> None:
    """A resumed run redoes the steps after its checkpoint: drop their samples (atomically)."""
    path = output_dir / SAMPLES_FILE
    if not path.exists():
        return
    kept = [r for r in read_samples(output_dir) if int(r.get("step", 0)) <= upto_step]
    tmp = output_dir / f".{SAMPLES_FILE}.tmp"
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), "utf-8")
    os.replace(tmp, path)
