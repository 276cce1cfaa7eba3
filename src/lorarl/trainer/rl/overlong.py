"""Completions cut at the length limit (finish reason "length"): DAPO's soft overlong punishment
and overlong masking, as pure functions of lengths and finish reasons.

A truncated completion never got to answer, so its reward says little about the answer and
pushes the policy toward ever-longer outputs; DAPO either masks such samples out of the loss
(overlong filtering) or shapes the reward by length (soft punishment).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class OverlongConfig:
    max_tokens: int  # data.maxResponseTokens, DAPO's L_max
    mask: bool = False
    soft_punishment: bool = False
    buffer_tokens: int = 1  # DAPO's L_cache
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.max_tokens <= 0 or self.buffer_tokens <= 0:
            raise ValueError(
                f"max_tokens and buffer_tokens must be > 0, got {self.max_tokens}, "
                f"{self.buffer_tokens}"
            )
        if self.penalty_factor <= 0:
            raise ValueError(f"penalty_factor must be > 0, got {self.penalty_factor}")


def soft_overlong_penalty(lengths: Tensor, cfg: OverlongConfig) -> Tensor:
    """DAPO's R_length: 0 up to ``L_max - L_cache`` tokens, then falling linearly to
    ``-penalty_factor`` at ``L_max`` (verl's ``overlong_buffer``); float ``[B]``."""
    expected = cfg.max_tokens - cfg.buffer_tokens
    exceed = (lengths.to(torch.float32) - expected).clamp(min=0.0)
    return -(exceed / cfg.buffer_tokens * cfg.penalty_factor).clamp(max=cfg.penalty_factor)


def truncated(finish_reasons: Sequence[str]) -> Tensor:
    """Bool ``[B]``: the engine stopped the completion at the length limit."""
    return torch.tensor([r == "length" for r in finish_reasons], dtype=torch.bool)
