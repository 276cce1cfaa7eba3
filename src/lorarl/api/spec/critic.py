"""`spec.critic`: PPO's value model, a second LoRA adapter on the same base plus a value head.

The critic shares the base model's weights with the actor (the policy adapter), so it costs a
LoRA adapter and one linear layer, not a second model. Its defaults follow verl's critic where
they carry over to LoRA (verl's ppo_trainer: critic lr 1e-5 for a full critic, cliprange_value
0.5, critic_warmup 0, grad_clip 1.0)."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from lorarl.api.base import ApiModel
from lorarl.api.rules import Rule, enforce, rules_schema_extra
from lorarl.api.spec.algorithm import OptimSpec

_ALL_LINEAR_ALONE = Rule(
    cel="!has(self.targetModules) || !('all-linear' in self.targetModules) || "
    "size(self.targetModules) == 1",
    message="'all-linear' cannot be combined with other module names",
    check=lambda m: (
        m.target_modules is None
        or "all-linear" not in m.target_modules
        or len(m.target_modules) == 1
    ),
    field="targetModules",
)


class CriticLoraSpec(ApiModel):
    """The critic adapter's shape; every field unset takes the actor's (spec.lora) value."""

    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_ALL_LINEAR_ALONE))

    rank: int | None = Field(
        default=None, gt=0, le=1024, description="LoRA rank of the critic. Default: lora.rank."
    )
    alpha: float | None = Field(
        default=None,
        gt=0,
        le=65536,
        description="LoRA alpha of the critic (scale alpha/r). Default: lora.alpha.",
    )
    target_modules: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="Modules the critic adapts: ['all-linear'] or module names. Default: "
        "lora.targetModules.",
    )
    exclude_modules: list[str] | None = Field(
        default=None,
        max_length=64,
        description="Module names the critic leaves without LoRA. Default: lora.excludeModules.",
    )
    use_rslora: bool | None = Field(
        default=None,
        description="Rank-stabilized scaling alpha/sqrt(r) for the critic. Default: "
        "lora.useRslora.",
    )

    _rules = enforce(_ALL_LINEAR_ALONE)


class CriticOptimSpec(OptimSpec):
    """The critic's own AdamW: its loss (a regression onto returns) has another scale than the
    policy loss, so it gets its own learning rate and gradient clip."""

    lr: float = Field(
        default=1e-4,
        gt=0,
        le=1,
        description="The critic's AdamW learning rate. verl's critic uses 1e-5 (10x its actor's "
        "1e-6) for a full critic; LoRA wants about 10x the full rate, as for the actor's "
        "optim.lr: 1e-4.",
    )
    grad_clip: float = Field(
        default=1.0,
        gt=0,
        le=1e6,
        description="Max global gradient norm of the critic's parameters (critic LoRA and value "
        "head), clipped apart from the actor's (verl's critic grad_clip 1.0).",
    )


class CriticSpec(ApiModel):
    """ppo's value model. Unset (or {}) with ppo: every default below."""

    lora: CriticLoraSpec = Field(
        default_factory=CriticLoraSpec,
        description="The critic adapter (PEFT adapter 'critic' on the base); unset fields take "
        "spec.lora's values.",
    )
    optim: CriticOptimSpec = Field(
        default_factory=CriticOptimSpec,
        description="The critic's optimizer (separate from spec.optim, the actor's).",
    )
    value_clip: float = Field(
        default=0.5,
        gt=0,
        le=1e6,
        description="Clipped value loss: a new value may move at most this far from the value "
        "at sampling time before the clipped loss takes over (verl's cliprange_value 0.5).",
    )
    warmup_steps: int = Field(
        default=0,
        ge=0,
        le=10_000_000,
        description="Steps that train only the critic before the actor moves (verl's "
        "critic_warmup 0): a fresh critic's values are 0, so early advantages are the raw "
        "returns; a few warmup steps give the actor a baseline from its first update.",
    )
    vf_coef: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="Scale of the value loss before the critic's gradient clip (1.0: the loss "
        "as is). The critic has its own AdamW, which is scale-invariant, so this is no balance "
        "against the policy loss: it decides how soon optim.gradClip bites.",
    )


# spec-level rules (they read spec.algorithm and spec.training as well)
_CRITIC_PPO_ONLY_RULE = Rule(
    cel="!has(self.critic) || self.algorithm.name == 'ppo'",
    message="the critic (value model) is used by ppo only: set algorithm.name ppo or leave "
    "critic unset",
    check=lambda m: m.critic is None or m.algorithm.name == "ppo",
    field="critic",
)
_CRITIC_WARMUP_RULE = Rule(
    # With training.epochs the step count is known only once the trainer has read the data: it
    # checks this rule then (trainer/data/epochs.py).
    cel="!has(self.critic) || has(self.training.epochs) || self.critic.warmupSteps < "
    "(has(self.training.totalSteps) ? self.training.totalSteps : 100)",
    message="must be less than training.totalSteps: the actor would never be trained",
    check=lambda m: (
        m.critic is None or m.training.steps is None or m.critic.warmup_steps < m.training.steps
    ),
    field="critic.warmupSteps",
)
CRITIC_SPEC_RULES = (_CRITIC_PPO_ONLY_RULE, _CRITIC_WARMUP_RULE)
