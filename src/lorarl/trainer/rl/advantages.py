"""Advantage estimators: rewards in, per-sample (or per-token for GAE) advantages out.

Sequence-level estimators return one advantage per sample, shape ``[B]``; samples of one prompt are
contiguous (``group_size`` of them in a row), which is how the rollout client returns them.
``to_token_advantages`` broadcasts them over the response tokens. PPO's advantages are per token:
``gae`` over a critic's values, then ``whiten``; its registered estimator returns zeros.

Standard deviations are Bessel-corrected (``unbiased=True``) everywhere, as in verl and TRL, so
a run here and a run of the peers on the same rewards produce the same advantages. A group whose
rewards are all equal gets exactly zero advantage: its normalized value would be rounding noise
divided by ``eps``, not signal. (REINFORCE++-baseline whitens the centred values over the whole
batch afterwards, as verl does, so such a group ends at ``-mean / std`` of the batch, like verl.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "TOKEN_WEIGHTED",
    "compute_advantages",
    "constant_groups",
    "explained_variance",
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
    rewards: Tensor,
    group_size: int | None = None,
    *,
    token_counts: Tensor | list[int],
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++ as verl and OpenRLHF compute it: every response token carries its sequence's
    return, and the returns are whitened over *all response tokens of the batch* (verl's
    ``masked_whiten``), not over sequences. With ``group_size``, the group mean is subtracted
    first (REINFORCE++-baseline), which removes prompt difficulty before the global scaling.

    Rewards are outcome rewards and nothing is discounted (``gamma`` is 1 outside ppo), so every
    token of a sequence has the same return and the same whitened advantage: the result is one
    value per sample, ``[B]``. ``token_counts [B]`` are the response tokens each sample
    contributes (the loss-mask tokens: a multi-turn episode's observation tokens do not count).
    Long sequences weigh more in the mean and the variance: with one short right and one long
    wrong answer type, the short right one gets the large advantage. Mean ``sum(n_i x_i) / N``,
    Bessel-corrected variance over the ``N`` tokens, advantage ``(x - mean) * rsqrt(var + eps)``
    (verl's ``eps`` 1e-8). Fewer than 2 tokens, or one value everywhere: zeros.
    """
    if group_size is None:
        x = _as_rewards(rewards)
    else:
        g = group_rewards(rewards, group_size)
        centered = (g - g.mean(dim=1, keepdim=True)).masked_fill(
            constant_groups(g).unsqueeze(1), 0.0
        )
        x = centered.reshape(-1)
    counts = torch.as_tensor(token_counts, device=x.device)
    if counts.shape != x.shape:
        raise ValueError(
            f"token_counts must be [batch={x.numel()}], got shape {tuple(counts.shape)}"
        )
    if counts.is_floating_point() or bool((counts < 0).any()):
        raise ValueError("token_counts must be integer counts >= 0")
    weights = counts.to(torch.float64)
    n = weights.sum()
    present = counts > 0
    if n < 2 or bool(constant_groups(x[present].view(1, -1))[0]):
        return torch.zeros_like(x)
    x64 = x.to(torch.float64)
    mean = (weights * x64).sum() / n
    var = (weights * (x64 - mean) ** 2).sum() / (n - 1)
    return ((x64 - mean) * torch.rsqrt(var + eps)).to(x.dtype)


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
    present = mask.to(torch.bool)
    values = torch.where(present, values, torch.zeros_like(values))  # NaN on padding stays out
    m = present.to(values.dtype)
    n = m.sum()
    if n < 2:
        raise ValueError(f"whiten needs at least 2 unmasked values, got {int(n.item())}")
    mean = (values * m).sum() / n
    var = (((values - mean) ** 2) * m).sum() / (n - 1)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def last_token_rewards(rewards: Tensor, mask: Tensor, *, allow_empty: bool = False) -> Tensor:
    """Place each sequence reward on its last unmasked token (``[B]`` -> ``[B, T]``), for GAE.

    A row with no response tokens is an error unless ``allow_empty``: then it gets all zeros (the
    all-padding filler rows that give every rank the same number of micro-batches).
    """
    rewards = _as_rewards(rewards)
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"mask must be [batch={rewards.shape[0]}, tokens], got shape {tuple(mask.shape)}"
        )
    present = mask.to(device=rewards.device, dtype=torch.bool)
    has_tokens = present.any(dim=1)
    if not allow_empty and not bool(has_tokens.all()):
        empty = (~has_tokens).nonzero().flatten().tolist()[:10]
        raise ValueError(f"sequences with no response tokens at batch indices {empty}")
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    n_tokens = mask.shape[1]
    if n_tokens == 0:
        return out
    # index of the last True per row: argmax over the reversed row
    last = n_tokens - 1 - present.flip(1).to(torch.int8).argmax(dim=1)
    rows = torch.arange(mask.shape[0], device=rewards.device)
    out[rows, last] = torch.where(has_tokens, rewards, 0.0)
    return out


def _check_finite_masked(x: Tensor, present: Tensor, name: str) -> None:
    bad = present & ~torch.isfinite(x)
    if bad.any():
        where = [tuple(i) for i in bad.nonzero().tolist()[:5]]
        raise ValueError(f"{name} must be finite on response tokens; NaN/inf at {where}")


@torch.no_grad()
def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over ``[B, T]`` sequences, verl's semantics.

    ``values[:, t]`` is the critic's value of the state in which token ``t`` is generated. The
    recursion runs over the unmasked tokens only: a masked token (prompt, padding, or a tool
    observation inside a multi-turn response) is skipped, so the next value and the lambda
    accumulator carry over it unchanged, and the value after a sequence's last token is 0 (the
    episode ends there). Whatever sits on masked positions never leaks in, NaN included.
    Returns raw ``(advantages, returns)`` with ``returns = advantages + values`` (the critic's
    targets), both 0 outside the mask; whiten the advantages afterwards (over every rank).
    """
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be 2-D, got shape {tuple(token_rewards.shape)}")
    _check_mask(values, token_rewards.shape, "values")
    _check_mask(mask, token_rewards.shape)
    for name, x in (("gamma", gamma), ("lam", lam)):
        if isinstance(x, bool) or not isinstance(x, int | float) or not 0.0 <= x <= 1.0:
            raise ValueError(f"{name} must be a number in [0, 1], got {x!r}")
    present = mask.to(torch.bool)
    dtype = torch.promote_types(values.dtype, torch.float32)
    _check_finite_masked(values, present, "values")
    _check_finite_masked(token_rewards, present, "token_rewards")
    values = values.to(dtype)
    rewards = token_rewards.to(dtype)
    adv = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    last = torch.zeros_like(next_value)
    cols = present.any(dim=0).nonzero().flatten()
    if cols.numel():  # columns outside [first, last] response token change nothing
        for t in range(int(cols[-1]), int(cols[0]) - 1, -1):
            here = present[:, t]
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            last = torch.where(here, delta + gamma * lam * last, last)
            next_value = torch.where(here, values[:, t], next_value)
            adv[:, t] = last
    zero = torch.zeros((), dtype=dtype, device=values.device)
    adv = torch.where(present, adv, zero)
    return adv, torch.where(present, adv + values, zero)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float,
    *,
    num_tokens: float | Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped value loss and its clip fraction, as verl's ``compute_value_loss``.

    Loss: ``0.5 * sum(max((v - R)^2, (v_clip - R)^2)) / num_tokens`` over the masked tokens, where
    ``v_clip`` keeps the new value within ``clip_range`` of the value at rollout time, so one
    update cannot move the critic far on a single batch. ``num_tokens`` defaults to this batch's
    token count; pass the global count when micro-batches or ranks share one token mean.
    Clip fraction: the share of tokens whose clipped error is strictly the larger (detached).
    """
    _check_mask(mask, values.shape)
    _check_mask(old_values, values.shape, "old_values")
    _check_mask(returns, values.shape, "returns")
    if (
        isinstance(clip_range, bool)
        or not isinstance(clip_range, int | float)
        or not 0 < clip_range < math.inf
    ):
        raise ValueError(f"clip_range must be a finite number > 0, got {clip_range!r}")
    present = mask.to(torch.bool)
    # where(), not a product, and first: NaN on padding must reach neither the sum nor its gradient
    values, old_values, returns = (
        torch.where(present, x, torch.zeros_like(x)) for x in (values, old_values, returns)
    )
    # clamp values into the band, not old + clamp(diff): an unclipped value must stay bit-equal,
    # or rounding makes its two errors differ and the clip fraction counts it
    clipped = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    unclipped_err = (values - returns) ** 2
    clipped_err = (clipped - returns) ** 2
    total = torch.maximum(unclipped_err, clipped_err).sum()
    m = present.to(total.dtype)
    if num_tokens is None:
        denom = m.sum().clamp(min=1.0)
    else:
        denom = torch.as_tensor(num_tokens, dtype=total.dtype, device=total.device)
        if not bool(denom > 0):
            raise ValueError(f"num_tokens must be > 0, got {float(denom)}")
    frac = ((clipped_err > unclipped_err) & present).to(m.dtype).sum() / m.sum().clamp(min=1.0)
    return 0.5 * total / denom, frac.detach()


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var(returns - values) / (Var(returns) + 1e-5)`` over the masked tokens (0-dim).

    The critic's fit: 1 is perfect, 0 is no better than a constant, negative is worse. The same
    formula as verl's ``critic/vf_explained_var`` (Bessel-corrected variances, the 1e-5 guard
    against a constant return). NaN when fewer than 2 tokens are masked in: it is undefined.
    """
    _check_mask(mask, values.shape)
    _check_mask(returns, values.shape, "returns")
    present = mask.to(torch.bool)
    v = values.detach()[present].to(torch.promote_types(values.dtype, torch.float32))
    r = returns.detach()[present].to(v.dtype)
    if v.numel() < 2:
        return torch.tensor(float("nan"), dtype=v.dtype, device=v.device)
    return 1.0 - (r - v).var(unbiased=True) / (r.var(unbiased=True) + 1e-5)


def _grpo(rewards: Tensor, group_size: int, *, eps: float = 1e-6) -> Tensor:
    return grpo_advantages(rewards, group_size, scale_by_std=True, eps=eps)


def _dr_grpo(rewards: Tensor, group_size: int) -> Tensor:
    return grpo_advantages(rewards, group_size, scale_by_std=False)


def _rloo(rewards: Tensor, group_size: int) -> Tensor:
    return rloo_advantages(rewards, group_size)


def _ppo(rewards: Tensor, group_size: int) -> Tensor:
    """All zeros: PPO's advantages are per token, from ``gae`` over the critic's values later."""
    return torch.zeros_like(_as_rewards(rewards))


def _reinforce_pp(rewards: Tensor, group_size: int, *, token_counts, eps: float = 1e-8) -> Tensor:
    return reinforce_pp_advantages(rewards, None, token_counts=token_counts, eps=eps)


def _reinforce_pp_baseline(
    rewards: Tensor, group_size: int, *, token_counts, eps: float = 1e-8
) -> Tensor:
    return reinforce_pp_advantages(rewards, group_size, token_counts=token_counts, eps=eps)


# name -> (estimator, options it accepts)
ADVANTAGE_ESTIMATORS: dict[str, tuple[Callable[..., Tensor], tuple[str, ...]]] = {
    "grpo": (_grpo, ("eps",)),
    "dr_grpo": (_dr_grpo, ()),
    "dapo": (_grpo, ("eps",)),  # DAPO changes sampling and clipping, not the advantage
    "rloo": (_rloo, ()),
    "reinforce_pp": (_reinforce_pp, ("eps",)),
    "reinforce_pp_baseline": (_reinforce_pp_baseline, ("eps",)),
    "ppo": (_ppo, ()),
}
# Estimators that whiten over response tokens and so need each sample's token count.
TOKEN_WEIGHTED = frozenset({"reinforce_pp", "reinforce_pp_baseline"})


def compute_advantages(
    name: str,
    rewards: Tensor,
    group_size: int,
    *,
    token_counts: Tensor | list[int] | None = None,
    **opts: float,
) -> Tensor:
    """Per-sample advantages ``[B]`` for the algorithm ``name``.

    ``reinforce_pp`` ignores groups (whitening over the batch's response tokens);
    ``reinforce_pp_baseline`` subtracts the group mean first; both need ``token_counts`` (each
    sample's response tokens), the others ignore it. ``ppo`` gives zeros here: its per-token
    advantages come later, from ``gae`` over the critic's values.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        valid = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid names: {valid} (ppo's are zeros here: "
            "its per-token advantages come from gae() over the critic's values)"
        )
    fn, accepted = ADVANTAGE_ESTIMATORS[name]
    unknown = sorted(set(opts) - set(accepted))
    if unknown:
        raise ValueError(
            f"options {unknown} are not used by {name!r}; accepted: {list(accepted) or 'none'}"
        )
    if name in TOKEN_WEIGHTED:
        if token_counts is None:
            raise ValueError(f"{name!r} whitens over response tokens: pass token_counts")
        return fn(rewards, group_size, token_counts=token_counts, **opts)
    return fn(rewards, group_size, **opts)
