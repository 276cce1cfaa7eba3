"""The reward section of the LoRARLJob spec (`spec.reward`): which function scores completions
and, optionally, the Ray Serve service that runs it."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, ValidationInfo, model_validator

from lorarl.api.base import MAX_SECONDS, ApiModel
from lorarl.api.k8s import ResourceRequirements
from lorarl.api.rules import Rule, crd_only, enforce, named_check_error, rules_schema_extra

_MAX_REPLICAS_RULE = Rule(
    cel="!has(self.maxReplicas) || self.maxReplicas >= self.replicas",
    message="must be at least replicas (the autoscaler's lower bound)",
    check=lambda m: m.max_replicas is None or m.max_replicas >= m.replicas,
    field="maxReplicas",
)


def _resources_set(r: ResourceRequirements) -> bool:
    return bool(r.requests or r.limits)


# replicas, maxReplicas and resources size the service lorarl runs; an external one sizes itself.
_EXTERNAL_SERVICE_RULE = Rule(
    cel="!has(self.url) || ((!has(self.replicas) || self.replicas == 1) && "
    "!has(self.maxReplicas) && (!has(self.resources) || ((!has(self.resources.requests) || "
    "size(self.resources.requests) == 0) && (!has(self.resources.limits) || "
    "size(self.resources.limits) == 0))))",
    message="replicas, maxReplicas and resources size the reward service lorarl runs; with url "
    "(your own service) they would be ignored: leave them unset",
    check=lambda m: (
        m.url is None
        or (m.replicas == 1 and m.max_replicas is None and not _resources_set(m.resources))
    ),
)


class RewardServiceSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra=rules_schema_extra(_MAX_REPLICAS_RULE, _EXTERNAL_SERVICE_RULE)
    )

    url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        description="An existing reward service (e.g. a KubeRay RayService); lorarl runs one "
        "itself when unset.",
    )
    replicas: int = Field(default=1, ge=1, le=64, description="Serve replicas per deployment.")
    max_replicas: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Autoscaling upper bound (autoscaling off if unset).",
    )
    timeout_seconds: float = Field(
        default=60.0, gt=0, le=MAX_SECONDS, description="Timeout per scoring call."
    )
    max_retries: int = Field(default=3, ge=0, le=20, description="Retries before the step fails.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Reward pod resources."
    )

    _rules = enforce(_MAX_REPLICAS_RULE, _EXTERNAL_SERVICE_RULE)


_ONE_REWARD_SOURCE = Rule(
    cel="(has(self.__function__) ? 1 : 0) + (has(self.entrypoint) ? 1 : 0) == 1",
    message="set exactly one of function or entrypoint",
    check=lambda m: (m.function is not None) + (m.entrypoint is not None) == 1,
)


# The /score protocol carries the reward's name, not its params: an external service scores
# with its own. Python only (params is schemaless in the CRD, out of CEL's reach).
_EXTERNAL_PARAMS_RULE = Rule(
    cel=None,
    message="an external reward service (service.url) scores with its own settings; params "
    "would be ignored: leave them empty",
    check=lambda m: m.service is None or m.service.url is None or not m.params,
    field="params",
)


class RewardSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_ONE_REWARD_SOURCE))

    function: str | None = Field(
        default=None,
        min_length=1,
        description="Built-in reward: exact_match, math_answer, multiple_choice, regex_match, "
        "json_valid, format, ...",
    )
    entrypoint: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="A reward function from your image, as module:function.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the reward function (not with service.url: an "
        "external service scores with its own settings).",
    )
    service: RewardServiceSpec | None = Field(
        default=None,
        description="Score through a Ray Serve reward service instead of inside the trainer; "
        "each request names the reward (function or entrypoint).",
    )

    _rules = enforce(_ONE_REWARD_SOURCE, _EXTERNAL_PARAMS_RULE)

    @model_validator(mode="after")
    def _known_reward(self, info: ValidationInfo) -> RewardSpec:
        """A built-in name and its params are checked where the job is admitted (`lorarl
        validate`, the webhook), not first when the trainer starts; nothing heavy is imported.
        Python only: the CRD cannot know the registry. An external service (service.url)
        defines its own names."""
        external = self.service is not None and self.service.url is not None
        if self.function is None or external or crd_only(info):
            return self
        from lorarl.rewards.registry import UnknownRewardError, check_reward

        try:
            check_reward(self.function, self.params)
        except UnknownRewardError as exc:
            field, value, message = "function", self.function, str(exc)
        except ValueError as exc:
            field, value, message = "params", self.params, str(exc)
        else:
            return self
        raise named_check_error(field, value, message)
