"""Advantage estimators: rewards in, per-sample (or per-token for GAE) advantages out.

Sequence-level estimators return one advantage per sample, shape ``[B]``; samples of one prompt are
contiguous (``group_size`` of them in a row), which is how the rollout client returns them.
``to_token_advantages`` broadcasts them over the response tokens.

Standard deviations are Bessel-corrected (``unbiased=True``) everywhere, as in verl and TRL, so
a run here and a run of the peers on the same rewards produce the same advantages. A group whose
rewards are all equal gets exactly zero advantage: its normalized value would be rounding noise
divided by ``eps``, not signal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "compute_advantages",
    "constant_groups",
    "gae",
    "group_rewards",
    "grpo_advantages",
    "last_token_rewards",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "to_token_advantages",
    "value_loss",
    "whiten",
]


def _as_rewards(rewards: Tensor) -> Tensor:
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [batch], got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    bad = ~torch.isfinite(rewards)
    if bad.any():
        idx = bad.nonzero().flatten().tolist()[:10]
        raise ValueError(f"rewards must be finite; NaN/inf at indices {idx}")
    return rewards


def group_rewards(rewards: Tensor, group_size: int, *, min_size: int = 2) -> Tensor:
    """Validate ``rewards [B]`` and view it as ``[B // group_size, group_size]``."""
    rewards = _as_rewards(rewards)
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < min_size:
        raise ValueError(f"group_size must be >= {min_size}, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size {group_size} does not divide the batch of {rewards.numel()} rewards"
        )
    return rewards.view(-1, group_size)


def constant_groups(grouped: Tensor, atol: float = 0.0) -> Tensor:
    """Bool ``[G]``: True where a group's rewards span at most ``atol`` (no learning signal)."""
    spread = grouped.max(dim=1).values - grouped.min(dim=1).values
    return spread <= atol


def grpo_advantages(
    rewards: Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)``; ``scale_by_std=False`` is Dr.GRPO.

    Dr.GRPO drops the std division because it up-weights groups that are nearly all right or all
    wrong (small std), a bias toward too-easy and too-hard prompts.
    """
    g = group_rewards(rewards, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (g.std(dim=1, unbiased=True, keepdim=True) + eps)
    adv = adv.masked_fill(constant_groups(g).unsqueeze(1), 0.0)
    return adv.reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: ``A_i = r_i - mean_{j != i} r_j``, the baseline excludes the sample it judges."""
    g = group_rewards(rewards, group_size)
    others_mean = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    adv = (g - others_mean).masked_fill(constant_groups(g).unsqueeze(1), 0.0)
    return adv.reshape(-1)


def reinforce_pp_advantages(
    rewards: Tensor, group_size: int | None = None, *, eps: float = 1e-6
) -> Tensor:
    """REINFORCE++: normalize over the whole batch; with ``group_size``, subtract the group mean
    first (REINFORCE++-baseline), which removes prompt difficulty before the global scaling.
    """
    if group_size is None:
        x = _as_rewards(rewards)
    else:
        g = group_rewards(rewards, group_size)
        centered = (g - g.mean(dim=1, keepdim=True)).masked_fill(
            constant_groups(g).unsqueeze(1), 0.0
        )
        x = centered.reshape(-1)
    if x.numel() < 2 or bool(constant_groups(x.view(1, -1))[0]):
        return torch.zeros_like(x)
    return (x - x.mean()) / (x.std(unbiased=True) + eps)


def _check_mask(mask: Tensor, shape: torch.Size, name: str = "mask") -> None:
    if mask.dim() != 2:
        raise ValueError(f"{name} must be 2-D [batch, tokens], got shape {tuple(mask.shape)}")
    if mask.shape != shape:
        raise ValueError(f"{name} shape {tuple(mask.shape)} does not match {tuple(shape)}")


def to_token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Broadcast per-sample ``[B]`` advantages over tokens ``[B, T]``; padding gets 0."""
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be 1-D [batch], got shape {tuple(advantages.shape)}")
    if mask.dim() != 2 or mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"mask must be [batch={advantages.shape[0]}, tokens], got shape {tuple(mask.shape)}"
        )
    return advantages.unsqueeze(1) * mask.to(advantages.dtype)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalize over the masked tokens of the whole batch (PPO advantage whitening).

    ``shift_mean=False`` keeps the mean, only rescales: used when the sign of the signal matters.
    Padding positions come back as 0.
    """
    _check_mask(mask, values.shape)
    m = mask.to(values.dtype)
    n = m.sum()
    if n < 2:
        raise ValueError(f"whiten needs at least 2 unmasked values, got {int(n.item())}")
    mean = (values * m).sum() / n
    var = (((values - mean) ** 2) * m).sum() / (n - 1)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def last_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence reward on its last unmasked token (``[B]`` -> ``[B, T]``), for GAE."""
    rewards = _as_rewards(rewards)
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"mask must be [batch={rewards.shape[0]}, tokens], got shape {tuple(mask.shape)}"
        )
    lengths = mask.to(torch.long).sum(dim=1)
    if (lengths == 0).any():
        empty = (lengths == 0).nonzero().flatten().tolist()
        raise ValueError(f"sequences with no response tokens at batch indices {empty}")
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    out[torch.arange(mask.shape[0], device=mask.device), lengths - 1] = rewards
    return out


@torch.no_grad()
def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over right-padded ``[B, T]`` sequences.

    The value after a sequence's last token is 0 (the episode ends there), so padding never leaks
    into the bootstrap. Returns ``(advantages, returns)``, both 0 on padding; ``returns`` are the
    value-function targets ``advantages + values``.
    """
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be 2-D, got shape {tuple(token_rewards.shape)}")
    _check_mask(values, token_rewards.shape, "values")
    _check_mask(mask, token_rewards.shape)
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    m = mask.to(values.dtype)
    rewards = token_rewards.to(values.dtype) * m
    values = values * m
    adv = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    n_tokens = values.shape[1]
    for t in reversed(range(n_tokens)):
        if t + 1 < n_tokens:
            next_value, next_mask = values[:, t + 1], m[:, t + 1]
        else:
            next_value, next_mask = torch.zeros_like(last), torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value * next_mask - values[:, t]
        last = delta + gamma * lam * next_mask * last
        adv[:, t] = last
    adv = adv * m
    return adv, (adv + values) * m


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range: float
) -> Tensor:
    """PPO clipped value loss: token mean of ``0.5 * max((v - R)^2, (v_clip - R)^2)``.

    ``v_clip`` keeps the new value within ``clip_range`` of the value at rollout time, so one
    update cannot move the critic far on a single batch.
    """
    _check_mask(mask, values.shape)
    _check_mask(old_values, values.shape, "old_values")
    _check_mask(returns, values.shape, "returns")
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return _masked_mean(loss, mask)


def _grpo(rewards: Tensor, group_size: int, *, eps: float = 1e-6) -> Tensor:
    return grpo_advantages(rewards, group_size, scale_by_std=True, eps=eps)


def _dr_grpo(rewards: Tensor, group_size: int) -> Tensor:
    return grpo_advantages(rewards, group_size, scale_by_std=False)


def _rloo(rewards: Tensor, group_size: int) -> Tensor:
    return rloo_advantages(rewards, group_size)


def _reinforce_pp(rewards: Tensor, group_size: int, *, eps: float = 1e-6) -> Tensor:
    return reinforce_pp_advantages(rewards, None, eps=eps)


def _reinforce_pp_baseline(rewards: Tensor, group_size: int, *, eps: float = 1e-6) -> Tensor:
    return reinforce_pp_advantages(rewards, group_size, eps=eps)


# name -> (estimator, options it accepts)
ADVANTAGE_ESTIMATORS: dict[str, tuple[Callable[..., Tensor], tuple[str, ...]]] = {
    "grpo": (_grpo, ("eps",)),
    "dr_grpo": (_dr_grpo, ()),
    "dapo": (_grpo, ("eps",)),  # DAPO changes sampling and clipping, not the advantage
    "rloo": (_rloo, ()),
    "reinforce_pp": (_reinforce_pp, ("eps",)),
    "reinforce_pp_baseline": (_reinforce_pp_baseline, ("eps",)),
}


def compute_advantages(name: str, rewards: Tensor, group_size: int, **opts: float) -> Tensor:
    """Per-sample advantages ``[B]`` for the algorithm ``name``.

    ``reinforce_pp`` ignores groups (plain batch normalization); ``reinforce_pp_baseline``
    subtracts the group mean first. PPO is not here: it needs a critic, see ``gae``.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        valid = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        hint = " (ppo uses gae() with a value model)" if name == "ppo" else ""
        raise ValueError(f"unknown advantage estimator {name!r}{hint}; valid names: {valid}")
    fn, accepted = ADVANTAGE_ESTIMATORS[name]
    unknown = sorted(set(opts) - set(accepted))
    if unknown:
        raise ValueError(
            f"options {unknown} are not used by {name!r}; accepted: {list(accepted) or 'none'}"
        )
    return fn(rewards, group_size, **opts)
