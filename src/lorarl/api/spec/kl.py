"""The KL section of the algorithm (`spec.algorithm.kl`): the penalty against a reference policy,
as a loss term (every algorithm) or, with ppo, in the token rewards (verl's use_kl_in_reward)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from lorarl.api.base import ApiModel
from lorarl.api.rules import Rule, enforce, rules_schema_extra

_KL_OFF = "applies to the KL term, which is off (coef 0): set coef above 0 or leave it unset"
_KL_REFERENCE_OFF_RULE = Rule(
    cel="(has(self.coef) && self.coef > 0.0) || !has(self.reference) || self.reference == 'base'",
    message=_KL_OFF,
    check=lambda m: m.coef > 0 or m.reference == "base",
    field="reference",
)
_KL_ESTIMATOR_OFF_RULE = Rule(
    cel="(has(self.coef) && self.coef > 0.0) || !has(self.estimator) || self.estimator == 'k3'",
    message=_KL_OFF,
    check=lambda m: m.coef > 0 or m.estimator == "k3",
    field="estimator",
)
# The penalty in the rewards is coef (the initial beta) x KL per token: with coef 0 there is none.
_IN_REWARD_OFF_RULE = Rule(
    cel="!has(self.inReward) || !self.inReward || (has(self.coef) && self.coef > 0.0)",
    message="puts coef x KL into the token rewards, and coef is 0: set coef above 0 (the "
    "initial beta) or leave inReward unset",
    check=lambda m: not m.in_reward or m.coef > 0,
    field="inReward",
)
_CONTROLLER_RULE = Rule(
    cel="!has(self.controller) || self.controller == 'fixed' || "
    "(has(self.inReward) && self.inReward)",
    message="steers the KL coefficient in the rewards, which applies with inReward only",
    check=lambda m: m.controller == "fixed" or m.in_reward,
    field="controller",
)
_ADAPTIVE_ONLY = "applies to the adaptive KL controller only (controller: adaptive, with inReward)"
_ADAPTIVE = "(has(self.controller) && self.controller == 'adaptive')"
_TARGET_KL_RULE = Rule(
    cel=f"!has(self.targetKl) || self.targetKl == 0.1 || {_ADAPTIVE}",
    message=_ADAPTIVE_ONLY,
    check=lambda m: m.target_kl == 0.1 or m.controller == "adaptive",
    field="targetKl",
)
_HORIZON_RULE = Rule(
    cel=f"!has(self.horizon) || self.horizon == 10000 || {_ADAPTIVE}",
    message=_ADAPTIVE_ONLY,
    check=lambda m: m.horizon == 10000 or m.controller == "adaptive",
    field="horizon",
)
_KL_RULES = (
    _KL_REFERENCE_OFF_RULE,
    _KL_ESTIMATOR_OFF_RULE,
    _IN_REWARD_OFF_RULE,
    _CONTROLLER_RULE,
    _TARGET_KL_RULE,
    _HORIZON_RULE,
)


class KLSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(*_KL_RULES))

    reference: Literal["base", "initialAdapter"] = Field(
        default="base",
        description="The KL reference policy: base (the base model, adapter disabled) or "
        "initialAdapter (the adapter at lora.adapterPath as loaded, kept frozen on the same "
        "base: no second model copy).",
    )
    coef: float = Field(
        default=0.0,
        ge=0,
        le=1000,
        description="KL penalty coefficient against the base model (adapter disabled); 0 turns "
        "it off, as DAPO and Dr.GRPO recommend. With inReward it is the initial beta of the "
        "penalty in the rewards.",
    )
    estimator: Literal["k1", "k2", "k3", "low_var_kl", "mse"] = Field(
        default="k3",
        description="KL estimator (verl's names accepted: low_var_kl = k3, mse = k2). As a loss, "
        "k2/mse is the one whose gradient is the gradient of KL(pi || ref); k3 (low variance, "
        "non-negative) gives the gradient of KL(ref || pi) instead; k1's gradient is zero in "
        "expectation (the trainer warns). In the rewards (inReward) only its value counts. See "
        "docs/algorithms.md.",
    )
    in_reward: bool = Field(
        default=False,
        description="ppo only: subtract coef x KL per token from the token rewards (verl's "
        "use_kl_in_reward, the InstructGPT recipe) instead of adding a KL loss term; GAE then "
        "spreads the penalty over the response like the outcome reward.",
    )
    controller: Literal["fixed", "adaptive"] = Field(
        default="fixed",
        description="The in-reward beta: fixed (coef throughout) or adaptive (verl's kl_ctrl "
        "adaptive, Ziegler et al. 2019: beta is scaled each step by 1 + clip(KL / targetKl - 1, "
        "-0.2, 0.2) x steps / horizon). With inReward only.",
    )
    target_kl: float = Field(
        default=0.1,
        gt=0,
        le=1000,
        description="The per-token KL the adaptive controller steers toward (verl's default 0.1).",
    )
    horizon: int = Field(
        default=10000,
        ge=1,
        le=10_000_000,
        description="The adaptive controller's time constant in samples (verl's default 10000): "
        "larger moves beta more slowly.",
    )

    _rules = enforce(*_KL_RULES)
