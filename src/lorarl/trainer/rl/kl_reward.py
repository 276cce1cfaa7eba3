"""KL in the reward (PPO's ``kl.inReward``): the penalty moves from the loss into token rewards.

``r_t = score_t - beta * KL_t`` per response token, with ``KL_t`` the estimator the loss uses
(``losses.kl_penalty``) on the rollout policy's and the reference's logprobs. ``beta`` comes from a
``KLController``: fixed, or adaptive (Ziegler et al. 2019), which steers the measured KL toward a
target. Same arithmetic as verl's ``apply_kl_penalty`` and its KL controllers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lorarl.trainer.rl.losses import kl_penalty

__all__ = [
    "KL_CONTROLLERS",
    "KLController",
    "current_kl",
    "kl_in_reward",
    "per_sequence_kl",
]

KL_CONTROLLERS = ("fixed", "adaptive")
_ERROR_CLIP = 0.2  # the adaptive controller moves beta by at most 20% x n_steps / horizon


def _check_2d(name: str, x: Tensor, shape: torch.Size) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape != shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} does not match {tuple(shape)}")


@torch.no_grad()
def kl_in_reward(
    token_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    coef: float,
    estimator: str = "low_var_kl",
) -> tuple[Tensor, Tensor]:
    """``(token_rewards - coef * kl, kl)``, ``kl`` per token and 0 outside ``mask``.

    ``logprobs`` are the rollout policy's (the "old" ones PPO computes before its update): the
    penalty is part of the return the critic learns, so it must not move during the update.
    Masked positions get no penalty, whatever their logprobs hold (NaN included).
    """
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be 2-D, got shape {tuple(token_rewards.shape)}")
    for name, x in (("logprobs", logprobs), ("ref_logprobs", ref_logprobs), ("mask", mask)):
        _check_2d(name, x, token_rewards.shape)
    if isinstance(coef, bool) or not isinstance(coef, int | float) or not 0 <= coef < math.inf:
        raise ValueError(f"coef must be a finite number >= 0, got {coef!r}")
    present = mask.to(torch.bool)
    kl = kl_penalty(logprobs.detach(), ref_logprobs.detach(), estimator)
    bad = present & ~torch.isfinite(kl)
    if bad.any():
        where = [tuple(i) for i in bad.nonzero().tolist()[:5]]
        raise ValueError(
            f"logprobs/ref_logprobs give a non-finite KL on response tokens at {where}"
        )
    kl = torch.where(present, kl, torch.zeros_like(kl))
    return token_rewards - coef * kl, kl


def per_sequence_kl(kl_per_token: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's token-mean KL ``[B]`` (0 for a row with no tokens) and which rows have tokens.

    The two parts of ``current_kl``, so ranks can sum both and divide once for a global mean.
    """
    if kl_per_token.dim() != 2:
        raise ValueError(f"kl_per_token must be 2-D, got shape {tuple(kl_per_token.shape)}")
    _check_2d("mask", mask, kl_per_token.shape)
    present = mask.to(torch.bool)
    m = present.to(kl_per_token.dtype)
    sums = torch.where(present, kl_per_token, torch.zeros_like(kl_per_token)).sum(dim=1)
    counts = m.sum(dim=1)
    return sums / counts.clamp(min=1.0), counts > 0


def current_kl(kl_per_token: Tensor, mask: Tensor) -> float:
    """The batch's KL for the controller: the mean over sequences of each one's token-mean KL.

    As verl's ``apply_kl_penalty`` computes it, except that rows with no response tokens (the
    filler rows that equalize ranks) are left out instead of counting as KL 0. 0.0 when no row
    has tokens.
    """
    means, has_tokens = per_sequence_kl(kl_per_token, mask)
    n = int(has_tokens.sum())
    return float(means[has_tokens].sum()) / n if n else 0.0


class KLController:
    """The reward's KL coefficient ``value``: fixed, or adapted toward ``target_kl``.

    Adaptive: ``value *= 1 + clip(kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon`` after each
    batch (``n_steps`` = its number of sequences), so beta grows while the policy drifts too far
    from the reference and shrinks while it stays close. ``state_dict`` is a plain dict: a resumed
    run continues with exactly the beta it had.
    """

    def __init__(
        self,
        coef: float,
        controller: str = "fixed",
        *,
        target_kl: float = 0.1,
        horizon: int = 10000,
    ) -> None:
        if controller not in KL_CONTROLLERS:
            raise ValueError(
                f"kl controller must be one of {', '.join(KL_CONTROLLERS)}; got {controller!r}"
            )
        self.controller = controller
        self.value = _finite_number("coef", coef, minimum=0.0)
        self.target_kl = _finite_number("target_kl", target_kl, minimum=0.0, strict=True)
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon <= 0:
            raise ValueError(f"horizon must be an integer > 0, got {horizon!r}")
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move ``value`` after a batch of ``n_steps`` sequences whose KL was ``current_kl``."""
        kl = _finite_number("current_kl", current_kl)
        if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
            raise ValueError(f"n_steps must be an integer >= 0, got {n_steps!r}")
        if self.controller == "adaptive":
            error = min(max(kl / self.target_kl - 1, -_ERROR_CLIP), _ERROR_CLIP)
            self.value *= 1 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {
            "controller": self.controller,
            "value": self.value,
            "target_kl": self.target_kl,
            "horizon": self.horizon,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``value``; the saved controller kind must match this one's."""
        if not isinstance(state, dict) or "value" not in state:
            raise ValueError("KL controller state must be a dict with a 'value'")
        saved = state.get("controller")
        if saved != self.controller:
            raise ValueError(
                f"KL controller state is for {saved!r}, this run uses {self.controller!r}"
            )
        self.value = _finite_number("KL controller state value", state["value"], minimum=0.0)


def _finite_number(
    name: str, x: Any, *, minimum: float | None = None, strict: bool = False
) -> float:
    ok = not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x)
    if ok and minimum is not None:
        ok = x > minimum if strict else x >= minimum
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{name} must be a finite number{bound}, got {x!r}")
    return float(x)
