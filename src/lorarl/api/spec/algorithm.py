"""The algorithm and optimizer sections of the LoRARLJob spec (docs/algorithms.md says what
each choice does); documented field by field, since the CRD is generated from them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from lorarl.api.base import ApiModel
from lorarl.api.rules import Rule, enforce, rules_schema_extra
from lorarl.api.spec.kl import KLSpec

GROUP_ALGORITHMS = ("grpo", "dr_grpo", "dapo", "rloo")
Algorithm = Literal["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "ppo"]


_THRESHOLD_OFF_RULE = Rule(
    cel="!has(self.mode) || self.mode != 'off' || !has(self.threshold) || self.threshold == 2.0",
    message="applies to tis and the masks; with mode off it would be ignored: leave it unset",
    check=lambda m: m.mode != "off" or m.threshold == 2.0,
    field="threshold",
)


class RolloutCorrectionSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_THRESHOLD_OFF_RULE))

    mode: Literal["tis", "mask-token", "mask-sequence", "off"] = Field(
        default="tis",
        description="Correction for the engines not sampling exactly the trainer's policy "
        "(other precision and kernels, or one-step-old weights), from the ratio rho = "
        "pi_trainer / pi_engine per token: tis (truncated importance sampling, the loss of each "
        "token weighted by min(rho, threshold), as verl and TRL), mask-token (drop tokens with "
        "rho outside [1/threshold, threshold]), mask-sequence (drop sequences whose "
        "geometric-mean rho is outside it) or off.",
    )
    threshold: float = Field(
        default=2.0, gt=1, le=1000, description="The cap (tis) or the mask bound on rho."
    )

    _rules = enforce(_THRESHOLD_OFF_RULE)


class DynamicSamplingSpec(ApiModel):
    enabled: bool | None = Field(
        default=None,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal and refill. "
        "Default: on for dapo, off otherwise (with ppo such groups still teach the critic and "
        "get nonzero GAE advantages: dropping them discards signal).",
    )
    max_rounds: int = Field(
        default=3, ge=1, le=32, description="Generation rounds per step before giving up refilling."
    )
    metric: Literal["reward", "shaped-reward"] = Field(
        default="reward",
        description="What a group's samples must differ in to be kept: reward (spec.reward's "
        "score, before the soft overlong punishment: DAPO's and verl's accuracy filter) or "
        "shaped-reward (after the punishment, the value the advantages use; needs "
        "overlong.softPunishment). With reward, a group that is all right or all wrong is "
        "dropped even when its lengths differ.",
    )


_GROUP_SIZE_RULE = Rule(
    cel="!(self.name in ['grpo', 'dr_grpo', 'dapo', 'rloo']) || self.groupSize >= 2",
    message="must be at least 2 for group-based algorithms (grpo, dr_grpo, dapo, rloo)",
    check=lambda m: m.name not in GROUP_ALGORITHMS or m.group_size >= 2,
    field="groupSize",
)
_DYNAMIC_SAMPLING_RULE = Rule(
    cel="!has(self.dynamicSampling.enabled) || !self.dynamicSampling.enabled || "
    "self.groupSize >= 2",
    message="dynamic sampling needs groupSize of at least 2",
    check=lambda m: not m.dynamic_sampling.enabled or m.group_size >= 2,
    field="dynamicSampling",
)


class OverlongSpec(ApiModel):
    mask: bool | None = Field(
        default=None,
        description="Overlong filtering: completions cut at maxResponseTokens (finish reason "
        "'length') do not contribute to the loss. Default: off.",
    )
    soft_punishment: bool | None = Field(
        default=None,
        description="DAPO's soft overlong punishment: a completion longer than maxResponseTokens "
        "- bufferTokens gets a reward penalty growing linearly to penaltyFactor at "
        "maxResponseTokens. Default: on for dapo, off otherwise.",
    )
    buffer_tokens: int | None = Field(
        default=None,
        gt=0,
        le=131072,
        description="Length of the punishment buffer. Default: maxResponseTokens / 5 (DAPO: 4096 "
        "of 20480).",
    )
    penalty_factor: float = Field(
        default=1.0, gt=0, le=1000, description="Penalty at maxResponseTokens (DAPO: 1)."
    )


_SUM_AGGS = ("seq-mean-token-sum", "seq-mean-token-sum-norm")
_NORM_LENGTH_RULE = Rule(
    cel="!has(self.lossNormLength) || (has(self.lossAggregation) ? "
    "self.lossAggregation in ['seq-mean-token-sum', 'seq-mean-token-sum-norm'] : "
    "self.name == 'dr_grpo')",
    message="applies to lossAggregation seq-mean-token-sum(-norm) only (dr_grpo's default)",
    check=lambda m: (
        m.loss_norm_length is None
        or (m.loss_aggregation in _SUM_AGGS if m.loss_aggregation else m.name == "dr_grpo")
    ),
    field="lossNormLength",
)
_OVERLONG_BUFFER_RULE = Rule(
    cel="!has(self.overlong.bufferTokens) || (has(self.overlong.softPunishment) ? "
    "self.overlong.softPunishment : self.name == 'dapo')",
    message="applies to the soft overlong punishment only (on by default for dapo)",
    check=lambda m: (
        m.overlong.buffer_tokens is None
        or (
            m.overlong.soft_punishment
            if m.overlong.soft_punishment is not None
            else m.name == "dapo"
        )
    ),
    field="overlong.bufferTokens",
)
# Settings of a part of the recipe that is off would be ignored.
_MAX_ROUNDS_RULE = Rule(
    cel="!has(self.dynamicSampling.maxRounds) || self.dynamicSampling.maxRounds == 3 || "
    "(has(self.dynamicSampling.enabled) ? self.dynamicSampling.enabled : self.name == 'dapo')",
    message="applies to dynamic sampling only (on by default for dapo)",
    check=lambda m: (
        m.dynamic_sampling.max_rounds == 3
        or (
            m.dynamic_sampling.enabled
            if m.dynamic_sampling.enabled is not None
            else m.name == "dapo"
        )
    ),
    field="dynamicSampling.maxRounds",
)
_METRIC_RULE = Rule(
    cel="!has(self.dynamicSampling.metric) || self.dynamicSampling.metric == 'reward' || "
    "(has(self.dynamicSampling.enabled) ? self.dynamicSampling.enabled : self.name == 'dapo')",
    message="applies to dynamic sampling only (on by default for dapo)",
    check=lambda m: (
        m.dynamic_sampling.metric == "reward"
        or (
            m.dynamic_sampling.enabled
            if m.dynamic_sampling.enabled is not None
            else m.name == "dapo"
        )
    ),
    field="dynamicSampling.metric",
)
_SHAPED_METRIC_RULE = Rule(
    cel="!has(self.dynamicSampling.metric) || self.dynamicSampling.metric != 'shaped-reward' || "
    "(has(self.overlong.softPunishment) ? self.overlong.softPunishment : self.name == 'dapo')",
    message="shaped-reward differs from reward only with the soft overlong punishment (on by "
    "default for dapo): turn it on or leave metric unset",
    check=lambda m: (
        m.dynamic_sampling.metric != "shaped-reward"
        or (
            m.overlong.soft_punishment
            if m.overlong.soft_punishment is not None
            else m.name == "dapo"
        )
    ),
    field="dynamicSampling.metric",
)
_PENALTY_FACTOR_RULE = Rule(
    cel="!has(self.overlong.penaltyFactor) || self.overlong.penaltyFactor == 1.0 || "
    "(has(self.overlong.softPunishment) ? self.overlong.softPunishment : self.name == 'dapo')",
    message="applies to the soft overlong punishment only (on by default for dapo)",
    check=lambda m: (
        m.overlong.penalty_factor == 1.0
        or (
            m.overlong.soft_punishment
            if m.overlong.soft_punishment is not None
            else m.name == "dapo"
        )
    ),
    field="overlong.penaltyFactor",
)
# Only GAE (ppo, with its critic) discounts; every other estimator here scores whole sequences
# without discounting, so a changed gamma or lam would be silently ignored.
_GAE_ONLY = "is used by GAE (ppo) only: set name ppo or leave it unset"
_GAMMA_RULE = Rule(
    cel="!has(self.gamma) || self.gamma == 1.0 || self.name == 'ppo'",
    message=_GAE_ONLY,
    check=lambda m: m.gamma == 1.0 or m.name == "ppo",
    field="gamma",
)
_LAM_RULE = Rule(
    cel="!has(self.lam) || self.lam == 0.95 || self.name == 'ppo'",
    message=_GAE_ONLY,
    check=lambda m: m.lam == 0.95 or m.name == "ppo",
    field="lam",
)
# The KL penalty goes into the rewards only where per-token rewards exist: GAE's (ppo).
_KL_IN_REWARD_RULE = Rule(
    cel="!has(self.kl.inReward) || !self.kl.inReward || self.name == 'ppo'",
    message="puts the KL penalty into per-token rewards, which only ppo (GAE) uses: set name "
    "ppo or use the KL loss term (leave inReward unset)",
    check=lambda m: not m.kl.in_reward or m.name == "ppo",
    field="kl.inReward",
)
_ALGORITHM_RULES = (
    _KL_IN_REWARD_RULE,
    _GAMMA_RULE,
    _LAM_RULE,
    _GROUP_SIZE_RULE,
    _DYNAMIC_SAMPLING_RULE,
    _NORM_LENGTH_RULE,
    _OVERLONG_BUFFER_RULE,
    _PENALTY_FACTOR_RULE,
    _MAX_ROUNDS_RULE,
    _METRIC_RULE,
    _SHAPED_METRIC_RULE,
)


class AlgorithmSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(*_ALGORITHM_RULES))

    name: Algorithm = Field(
        default="grpo",
        description="grpo, dr_grpo (no std scaling, seq-mean-token-sum-norm), dapo (the DAPO "
        "recipe: clip-higher 0.28, dynamic sampling, token-mean, soft overlong punishment; each "
        "overridable), rloo, reinforce_pp, or ppo (GAE advantages from a LoRA critic on the same "
        "base: see spec.critic).",
    )
    group_size: int = Field(default=8, ge=1, le=1024, description="Samples generated per prompt.")
    clip_ratio_low: float = Field(
        default=0.2, ge=0, le=1, description="Lower clip: ratio >= 1 - clipRatioLow."
    )
    clip_ratio_high: float | None = Field(
        default=None,
        ge=0,
        le=10,
        description="Upper clip: ratio <= 1 + clipRatioHigh. Default: 0.28 for dapo "
        "(clip-higher), 0.2 otherwise.",
    )
    dual_clip: float | None = Field(
        default=3.0,
        gt=1,
        le=1000,
        description="Dual-clip bound c (verl's default 3): the loss of a negative-advantage token "
        "is capped at -A * c, so a token whose ratio exploded (stale or mismatched samples) "
        "cannot dominate the step. null turns it off.",
    )
    loss_aggregation: (
        Literal[
            "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
        ]
        | None
    ) = Field(
        default=None,
        description="How token losses become one number: token-mean (DAPO), seq-mean-token-mean "
        "(GRPO paper), seq-mean-token-sum, or seq-mean-token-sum-norm (Dr.GRPO: per-sequence "
        "sums divided by the constant lossNormLength). Default: seq-mean-token-sum-norm for "
        "dr_grpo, token-mean otherwise.",
    )
    loss_norm_length: int | None = Field(
        default=None,
        gt=0,
        le=1_048_576,
        description="The constant of seq-mean-token-sum-norm. Default: data.maxResponseTokens.",
    )
    overlong: OverlongSpec = Field(
        default_factory=OverlongSpec,
        description="Completions cut at maxResponseTokens: masking and DAPO's soft punishment.",
    )
    kl: KLSpec = Field(
        default_factory=KLSpec,
        description="KL penalty to the reference policy: a loss term, or (ppo) in the rewards.",
    )
    rollout_correction: RolloutCorrectionSpec = Field(
        default_factory=RolloutCorrectionSpec,
        description="Importance-sampling correction against the engines' logprobs (on: tis).",
    )
    entropy_coef: float = Field(default=0.0, ge=0, le=100, description="Entropy bonus coefficient.")
    dynamic_sampling: DynamicSamplingSpec = Field(
        default_factory=DynamicSamplingSpec, description="DAPO dynamic sampling."
    )
    ppo_epochs: int = Field(
        default=1, ge=1, le=16, description="Optimizer passes over each step's samples."
    )
    gamma: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="GAE discount factor (ppo; verl's default 1.0: rewards come at the end of a "
        "response, so discounting would only shrink them). No other algorithm discounts: "
        "refused with them unless 1.0.",
    )
    lam: float = Field(
        default=0.95,
        ge=0,
        le=1,
        description="GAE lambda (ppo; 0.95 as TRL's PPO, verl ships 1.0): 1 gives Monte-Carlo "
        "returns (no critic bias, most variance), 0 one-step TD (all critic). Refused with "
        "other algorithms unless 0.95.",
    )

    _rules = enforce(*_ALGORITHM_RULES)


class OptimSpec(ApiModel):
    lr: float = Field(
        default=1e-5,
        gt=0,
        le=1,
        description="AdamW learning rate. LoRA wants about 10x the full fine-tuning rate "
        "(verl's LoRA guide, 'LoRA Without Regret'): 1e-5 where full RL uses 1e-6.",
    )
    betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field(
        default_factory=lambda: [0.9, 0.999],
        min_length=2,
        max_length=2,
        description="AdamW betas.",
    )
    weight_decay: float = Field(default=0.0, ge=0, le=10, description="AdamW weight decay.")
    warmup_steps: int = Field(default=0, ge=0, le=10_000_000, description="Linear warmup steps.")
    scheduler: Literal["constant", "cosine"] = Field(
        default="constant", description="Learning-rate schedule after warmup."
    )
    grad_clip: float = Field(default=1.0, gt=0, le=1e6, description="Max global gradient norm.")
