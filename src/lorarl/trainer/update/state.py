"""What a checkpoint must hold to resume a run where it stopped, and the step's learning rate."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lorarl.trainer.data.prompts import DataPosition


def lr_at(step: int, base_lr: float, warmup: int, total: int, schedule: str) -> float:
    """LR for 1-based `step`: linear warmup, then constant or cosine to zero. A pure function of
    the step, so a resumed run needs no scheduler state."""
    if warmup and step <= warmup:
        return base_lr * step / warmup
    if schedule == "cosine":
        progress = (step - warmup) / max(total - warmup, 1)
        return base_lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return base_lr


@dataclass
class StepState:
    step: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    version: int = 0

    def to_dict(self) -> dict:
        return {"step": self.step, "position": self.position.to_dict(), "version": self.version}

    @classmethod
    def from_dict(cls, d: dict) -> StepState:
        return cls(d["step"], DataPosition.from_dict(d["position"]), d["version"])
