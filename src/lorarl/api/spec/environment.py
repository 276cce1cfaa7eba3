"""`spec.environment`: multi-turn rollouts, where an environment answers each model turn (a tool
result, a new user message) until the episode ends (docs/environments.md).

Unset, a sample is one completion of the prompt, as before. Set, a sample is an episode: the model's
turns are trained on, the environment's messages sit between them in the context with loss mask 0.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, model_validator

from lorarl.api.base import MAX_SECONDS, ApiModel
from lorarl.api.rules import Rule, crd_only, named_check_error

DEFAULT_MAX_TOTAL_TOKENS = 2048
DEFAULT_MAX_RESPONSE_TOKENS = 256  # data.maxResponseTokens' default, shared with spec.py


class EnvironmentSpec(ApiModel):
    entrypoint: str = Field(
        pattern=r"^([a-z][a-z0-9_]*|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
        description="A built-in environment (single_turn, tool_calling) or your own class from "
        "your image, as module:Class, constructed once per episode with params.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the environment class (tool_calling: tools, ...).",
    )
    max_turns: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Assistant turns per episode; an episode still running after them is cut "
        "(counted in truncatedFraction).",
    )
    max_total_tokens: int = Field(
        default=DEFAULT_MAX_TOTAL_TOKENS,
        ge=1,
        le=262144,
        description="Tokens after the prompt per episode, the model's and the environment's "
        "together; each turn may generate up to data.maxResponseTokens of what is left. An "
        "episode that reaches it is cut.",
    )
    episode_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        le=MAX_SECONDS,
        description="Wall-clock limit per episode (generation, environment and tools); an "
        "episode over it ends where it is, cut, with the rewards it has.",
    )
    turn_rewards: bool = Field(
        default=False,
        description="ppo only: each turn's environment reward goes on that turn's last model "
        "token, so GAE credits the turn that earned it; off, the episode's total reward sits on "
        "its last token. Group algorithms only see an episode's total.",
    )
    final_reward: bool = Field(
        default=True,
        description="Add spec.reward's score of the last assistant message (against the row's "
        "answer) to the environment's own rewards; false: the environment's rewards only.",
    )

    @model_validator(mode="after")
    def _known_environment(self, info: ValidationInfo) -> EnvironmentSpec:
        """A built-in name and its params are checked at admission (`lorarl validate`, the
        webhook), like a built-in reward; a module:Class is checked where the image has it."""
        if ":" in self.entrypoint or crd_only(info):
            return self
        from lorarl.environments.registry import UnknownEnvironmentError, check_environment

        value: Any
        try:
            check_environment(self.entrypoint, self.params)
        except UnknownEnvironmentError as exc:
            field, value, message = "entrypoint", self.entrypoint, str(exc)
        except ValueError as exc:
            field, value, message = "params", self.params, str(exc)
        else:
            return self
        raise named_check_error(field, value, message)


def completion_tokens(spec: Any) -> int:
    """Most tokens after the prompt in one sample: a completion, or a whole episode (the model's
    and the environment's tokens). The engines' context is the prompt budget plus this."""
    env = spec.environment
    return spec.data.max_response_tokens if env is None else env.max_total_tokens


_BUDGET = (
    "(has(self.environment.maxTotalTokens) ? self.environment.maxTotalTokens : "
    f"{DEFAULT_MAX_TOTAL_TOKENS})"
)
_RESPONSE = (
    "(has(self.data.maxResponseTokens) ? self.data.maxResponseTokens : "
    f"{DEFAULT_MAX_RESPONSE_TOKENS})"
)
# One full turn must fit the episode's budget, or data.maxResponseTokens would be a lie.
_TURN_FITS_RULE = Rule(
    cel=f"!has(self.environment) || {_BUDGET} >= {_RESPONSE}",
    message="must be at least data.maxResponseTokens (one full model turn)",
    check=lambda m: (
        m.environment is None or m.environment.max_total_tokens >= m.data.max_response_tokens
    ),
    field="environment.maxTotalTokens",
)
# With finalReward off nothing reads spec.reward: one other than the default would be ignored.
# (Compared with the default, not "was it written": the rendered job.yaml writes every default.)
_REWARD_UNUSED = (
    "is not used: environment.finalReward is false, so the environment's rewards are the "
    "episode's (leave reward unset, or set finalReward true)"
)
_REWARD_UNUSED_RULE = Rule(
    cel="!has(self.environment) || !has(self.environment.finalReward) || "
    "self.environment.finalReward || !has(self.reward) || (has(self.reward.__function__) && "
    "self.reward.__function__ == 'math_answer' && !has(self.reward.service))",
    message=_REWARD_UNUSED,
    check=lambda m: (
        m.environment is None
        or m.environment.final_reward
        or (m.reward.function == "math_answer" and m.reward.service is None)
    ),
    field="reward",
)
# The same, for params: schemaless in the CRD (an object without declared fields), which CEL
# cannot read, so Python only (the webhook enforces it in a cluster).
_REWARD_PARAMS_UNUSED_RULE = Rule(
    cel=None,
    message=_REWARD_UNUSED,
    check=lambda m: m.environment is None or m.environment.final_reward or not m.reward.params,
    field="reward",
)
_TURN_REWARDS_PPO_RULE = Rule(
    cel="!has(self.environment) || !has(self.environment.turnRewards) || "
    "!self.environment.turnRewards || self.algorithm.name == 'ppo'",
    message="per-turn token rewards need per-token advantages: algorithm.name ppo (group "
    "algorithms give one advantage per episode)",
    check=lambda m: (
        m.environment is None or not m.environment.turn_rewards or m.algorithm.name == "ppo"
    ),
    field="environment.turnRewards",
)
ENVIRONMENT_SPEC_RULES = (
    _TURN_FITS_RULE,
    _REWARD_UNUSED_RULE,
    _REWARD_PARAMS_UNUSED_RULE,
    _TURN_REWARDS_PPO_RULE,
)
