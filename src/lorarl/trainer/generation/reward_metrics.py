"""The reward function's own metrics (`RewardResult.metrics`: a verl dict's `acc`, ...) -> the
per-step means in `StepRecord.reward_metrics`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any


class RewardMetricMeans:
    """A scorer `(prompts, completions, truths, metadatas) -> results` that also keeps the mean
    of each metric its results report. Wrapping the scorer, rather than changing what it
    returns, lets every caller in a step (single-turn batches, episodes' final replies, dynamic
    sampling's refill rounds) count without a second return path. A key is averaged over the
    samples that reported it: a verl reward may add a key only for some answers."""

    def __init__(self, scorer: Callable[..., Sequence[Any]]) -> None:
        self.scorer = scorer
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def __call__(self, *args: Any) -> Sequence[Any]:
        results = self.scorer(*args)
        for result in results:
            for key, value in getattr(result, "metrics", {}).items():
                # a reward service's JSON is not checked by this process's to_result
                if isinstance(value, numbers.Real) and math.isfinite(value):
                    self._sums[key] = self._sums.get(key, 0.0) + float(value)
                    self._counts[key] = self._counts.get(key, 0) + 1
        return results

    def means(self) -> dict[str, float] | None:
        """Name -> mean, sorted by name; None when no result reported a metric."""
        if not self._sums:
            return None
        return {k: self._sums[k] / self._counts[k] for k in sorted(self._sums)}
