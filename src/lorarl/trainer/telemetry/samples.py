"""Sample completions (`training.samplesInterval`): every N steps rank 0 keeps a few prompts with
their completions, rewards and advantages, in outputDir/samples.jsonl
(`lorarl.api.reports.samples`) and
in the trackers' tables. Texts are cut to a bounded length so the file stays small."""

from __future__ import annotations

from typing import Any

from lorarl.api.spec.job import TrainingSpec
from lorarl.trainer.rl.samples import TrainSample

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
            # an episode keeps its role markers, so its turns stay readable
            "completion": clip(
                tokenizer.decode(s.completion_ids, skip_special_tokens=s.loss_mask is None)
            ),
            "reward": float(s.reward),
            "advantage": float(s.advantage),
            "finish_reason": s.finish_reason,
        }
        for s in picked
    ]
