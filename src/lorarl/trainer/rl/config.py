"""The spec's algorithm section as the RL math sees it: name-dependent defaults resolved once
(the CRD leaves those fields unset so that the algorithm's name can decide)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lorarl.trainer.rl.losses import LossConfig

if TYPE_CHECKING:  # the job is only read here: the rl package imports no api at run time
    from lorarl.api.resource import LoRARLJob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AlgorithmChoices:
    """The algorithm's name-dependent defaults, resolved (the CRD leaves these fields unset so
    that the name can decide; its descriptions state the defaults)."""

    clip_high: float
    agg: str
    norm_len: int | None
    dynamic_sampling: bool
    dynamic_metric: str  # "reward" (before the overlong punishment) or "shaped-reward"
    overlong_mask: bool
    soft_punishment: bool
    buffer_tokens: int
    penalty_factor: float


def algorithm_choices(job: LoRARLJob) -> AlgorithmChoices:
    a, max_response = job.spec.algorithm, job.spec.data.max_response_tokens
    dapo = a.name == "dapo"
    agg = a.loss_aggregation or ("seq-mean-token-sum-norm" if a.name == "dr_grpo" else "token-mean")
    norm = a.loss_norm_length
    if agg == "seq-mean-token-sum-norm" and norm is None:
        norm = max_response
    o = a.overlong
    return AlgorithmChoices(
        clip_high=a.clip_ratio_high if a.clip_ratio_high is not None else (0.28 if dapo else 0.2),
        agg=agg,
        norm_len=norm,
        dynamic_sampling=(
            a.dynamic_sampling.enabled if a.dynamic_sampling.enabled is not None else dapo
        ),
        dynamic_metric=a.dynamic_sampling.metric,
        overlong_mask=bool(o.mask),
        soft_punishment=o.soft_punishment if o.soft_punishment is not None else dapo,
        buffer_tokens=o.buffer_tokens or max(1, max_response // 5),
        penalty_factor=o.penalty_factor,
    )


def loss_config(job: LoRARLJob) -> LossConfig:
    """The spec's algorithm section as the loss sees it, name-dependent defaults resolved. With
    kl.inReward the KL is a reward penalty (`kl_reward_settings`), not a loss term: kl_coef 0."""
    a, c = job.spec.algorithm, algorithm_choices(job)
    in_reward = a.kl.in_reward
    if a.kl.coef > 0 and a.kl.estimator == "k1" and not in_reward:
        log.warning(
            "spec.algorithm.kl.estimator k1 as a loss has zero gradient in expectation: the KL "
            "term will not pull the policy toward the reference; use k2/mse (the gradient of "
            "KL(pi || ref)) or k3/low_var_kl"
        )
    return LossConfig(
        clip_low=a.clip_ratio_low,
        clip_high=c.clip_high,
        dual_clip=a.dual_clip,
        agg=c.agg,
        norm_len=c.norm_len,
        kl_coef=0.0 if in_reward else a.kl.coef,
        kl_estimator=a.kl.estimator,
        entropy_coef=a.entropy_coef,
        correction=a.rollout_correction.mode,
        correction_threshold=a.rollout_correction.threshold,
    )


def advantage_estimator(job: LoRARLJob) -> str:
    """The spec's algorithm name -> the advantage estimator in `advantages.py` ("ppo": per-token
    advantages come later, from GAE over the critic's values)."""
    algo = job.spec.algorithm
    if algo.name == "reinforce_pp":
        return "reinforce_pp_baseline" if algo.group_size > 1 else "reinforce_pp"
    return algo.name


@dataclass(frozen=True)
class KLRewardSettings:
    """The KL penalty in the token rewards (algorithm.kl.inReward): coef is the initial beta."""

    coef: float
    estimator: str
    controller: str  # fixed | adaptive
    target_kl: float
    horizon: int


def kl_reward_settings(job: LoRARLJob) -> KLRewardSettings | None:
    """None unless algorithm.kl.inReward (then the loss has no KL term: see `loss_config`)."""
    kl = job.spec.algorithm.kl
    if not kl.in_reward:
        return None
    return KLRewardSettings(
        coef=kl.coef,
        estimator=kl.estimator,
        controller=kl.controller,
        target_kl=kl.target_kl,
        horizon=kl.horizon,
    )
