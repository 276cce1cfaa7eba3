"""DAPO dynamic sampling: keep only groups whose rewards differ, until a batch is full.

A group where every sample got the same reward has zero advantage under GRPO-style estimators, so
it adds compute but no gradient, and it shrinks the effective batch. DAPO over-samples and drops
such groups. Everything here is pure bookkeeping: the trainer generates, calls ``add`` and checks
``ready``; no I/O, no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

from lorarl.trainer.rl.advantages import constant_groups, group_rewards

__all__ = ["DynamicSampler", "SampledBatch", "informative_groups"]

T = TypeVar("T")


def informative_groups(rewards: Tensor, group_size: int, *, atol: float = 1e-6) -> Tensor:
    """Bool ``[n_groups]``: False where a group's rewards span at most ``atol`` (std ~ 0)."""
    if atol < 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    return ~constant_groups(group_rewards(rewards, group_size), atol)


@dataclass(frozen=True)
class SampledBatch(Generic[T]):
    """What one step trains on, and what it cost to collect it."""

    samples: list[T]  # group-contiguous, in arrival order
    rewards: Tensor  # [n_groups * group_size], aligned with samples
    n_groups: int
    rounds: int  # generation rounds consumed
    dropped_groups: int  # uninformative groups discarded
    surplus_groups: int  # informative groups discarded because the batch was already full
    reached_target: bool  # False: max_rounds ran out first, the trainer may refill or go short


class DynamicSampler(Generic[T]):
    """Accumulates informative groups across generation rounds up to ``target_groups``.

    Keeps arrival order and never exceeds the target. After ``max_rounds`` rounds it is ready
    with whatever it has and ``reached_target`` says so: a hard prompt set cannot stall a step.
    """

    def __init__(
        self, target_groups: int, group_size: int, *, max_rounds: int, atol: float = 1e-6
    ) -> None:
        if target_groups < 1:
            raise ValueError(f"target_groups must be >= 1, got {target_groups}")
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 for dynamic sampling, got {group_size}")
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
        if atol < 0:
            raise ValueError(f"atol must be >= 0, got {atol}")
        self.target_groups = target_groups
        self.group_size = group_size
        self.max_rounds = max_rounds
        self.atol = atol
        self._reset()

    def _reset(self) -> None:
        self._samples: list[T] = []
        self._rewards: list[Tensor] = []
        self.rounds = 0
        self.dropped_groups = 0
        self.surplus_groups = 0

    @property
    def kept_groups(self) -> int:
        return len(self._rewards)

    @property
    def needed(self) -> int:
        """Informative groups still missing: what the next round should aim to produce."""
        return self.target_groups - self.kept_groups

    @property
    def ready(self) -> bool:
        return self.needed == 0 or self.rounds >= self.max_rounds

    def add(self, rewards: Tensor, samples: Sequence[T], *, keep_by: Tensor | None = None) -> int:
        """Take one generation round (``rewards [B]``, one sample each); return groups kept.

        ``keep_by [B]`` is what a group must vary in to be kept (default: ``rewards``): DAPO
        filters on accuracy, the task's reward before the overlong punishment, while the kept
        groups carry their shaped ``rewards`` on to the advantages.
        """
        if self.ready:
            raise RuntimeError("sampler is ready; call take() before adding another round")
        if len(samples) != rewards.numel():
            raise ValueError(
                f"samples has {len(samples)} items but rewards has {rewards.numel()} entries"
            )
        if keep_by is None:
            keep_by = rewards
        elif keep_by.shape != rewards.shape:
            raise ValueError(
                f"keep_by shape {tuple(keep_by.shape)} does not match rewards "
                f"{tuple(rewards.shape)}"
            )
        keep = informative_groups(keep_by, self.group_size, atol=self.atol).tolist()
        grouped = group_rewards(rewards, self.group_size)
        self.rounds += 1
        kept = 0
        for g, informative in enumerate(keep):
            if not informative:
                self.dropped_groups += 1
            elif self.needed == 0:
                self.surplus_groups += 1
            else:
                lo = g * self.group_size
                self._samples.extend(samples[lo : lo + self.group_size])
                self._rewards.append(grouped[g].detach().clone())
                kept += 1
        return kept

    def take(self, *, force: bool = False) -> SampledBatch[T]:
        """Hand over the collected batch and start over; ``force`` takes it before it is ready."""
        if not self.ready and not force:
            raise RuntimeError(
                f"sampler not ready: {self.kept_groups}/{self.target_groups} groups after "
                f"{self.rounds}/{self.max_rounds} rounds (pass force=True to take it anyway)"
            )
        rewards = torch.cat(self._rewards) if self._rewards else torch.empty(0)
        batch = SampledBatch(
            samples=self._samples,
            rewards=rewards,
            n_groups=self.kept_groups,
            rounds=self.rounds,
            dropped_groups=self.dropped_groups,
            surplus_groups=self.surplus_groups,
            reached_target=self.needed == 0,
        )
        self._reset()
        return batch
