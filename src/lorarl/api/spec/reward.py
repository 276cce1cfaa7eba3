"""The reward section of the LoRARLJob spec (`spec.reward`): which function scores completions
and, optionally, the Ray Serve service that runs it."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, ValidationInfo, model_validator

from lorarl.api.base import MAX_SECONDS, ApiModel
from lorarl.api.rules import Rule, crd_only, enforce, named_check_error, rules_schema_extra
from lorarl.api.spec.k8s import DNS1123_SUBDOMAIN, ResourceRequirements
from lorarl.entrypoints import is_file_entrypoint

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


# `package.module:function` from the image, or `path/to/file.py:function` (a file: on a claim,
# in the image, or in reward.configMap). A module part ending in `.py` is a file.
ENTRYPOINT_PATTERN = r"^([A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_]\w*$"
_FILE_ENTRYPOINT_CEL = r"self.entrypoint.matches('^[^:]+\\.py:')"


class RewardConfigMap(ApiModel):
    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        description="ConfigMap in the job's namespace holding the reward's Python file(s), e.g. "
        "`kubectl create configmap my-reward --from-file=my_reward.py`.",
    )
    mount_path: str = Field(
        pattern=r"^/.",
        description="Folder the ConfigMap is mounted at, read-only, in the pods that score "
        "(the trainer, lorarl's reward service); entrypoint names a file in it.",
    )


def _under(path: str, folder: str) -> bool:
    return path.startswith(folder if folder.endswith("/") else folder + "/")


_CONFIG_MAP_FILE_RULE = Rule(
    cel="!has(self.configMap) || (has(self.entrypoint) && self.entrypoint.startsWith("
    "self.configMap.mountPath.endsWith('/') ? self.configMap.mountPath : "
    "self.configMap.mountPath + '/'))",
    message="configMap holds the reward's code: entrypoint must name a file under its "
    "mountPath (mountPath/file.py:function)",
    check=lambda m: (
        m.config_map is None
        or (m.entrypoint is not None and _under(m.entrypoint, m.config_map.mount_path))
    ),
    field="entrypoint",
)
_CONFIG_MAP_EXTERNAL_RULE = Rule(
    cel="!has(self.configMap) || !has(self.service) || !has(self.service.url)",
    message="an external reward service (service.url) scores with its own code; configMap "
    "would be mounted nowhere: leave it out",
    check=lambda m: m.config_map is None or m.service is None or m.service.url is None,
    field="configMap",
)
# A pod's working directory is the image's: a relative file path names nothing the job controls.
_ABSOLUTE_FILE_RULE = Rule(
    cel=f"!has(self.entrypoint) || !{_FILE_ENTRYPOINT_CEL} || self.entrypoint.startsWith('/')",
    message="a reward file in a cluster is an absolute path (in reward.configMap, on a claim or "
    "in the image); a relative one is for `lorarl run --local`",
    check=lambda m: (
        m.entrypoint is None or not is_file_entrypoint(m.entrypoint) or m.entrypoint[0] == "/"
    ),
    field="entrypoint",
    cluster=True,
)
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


_REWARD_RULES = (
    _ONE_REWARD_SOURCE,
    _CONFIG_MAP_FILE_RULE,
    _CONFIG_MAP_EXTERNAL_RULE,
    _ABSOLUTE_FILE_RULE,
)


class RewardSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(*_REWARD_RULES))

    function: str | None = Field(
        default=None,
        min_length=1,
        description="Built-in reward: exact_match, math_answer, gsm8k (verl's strict '#### N'), "
        "gsm8k_lenient (the last number), multiple_choice, regex_match, json_valid, format, ...",
    )
    entrypoint: str | None = Field(
        default=None,
        max_length=4096,
        pattern=ENTRYPOINT_PATTERN,
        description="Your own reward function: package.module:function from the image, or "
        "path/to/file.py:function (verl's custom_reward_function path and name). lorarl's "
        "signature fn(prompt, completion, ground_truth, metadata, **params) or verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info, **params); it "
        "returns a float or a dict whose score is the reward and whose other numbers are "
        "metrics.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the reward function (not with service.url: an "
        "external service scores with its own settings).",
    )
    config_map: RewardConfigMap | None = Field(
        default=None,
        description="A ConfigMap with the reward's code, mounted read-only where the reward "
        "runs; entrypoint names a file in it.",
    )
    service: RewardServiceSpec | None = Field(
        default=None,
        description="Score through a Ray Serve reward service instead of inside the trainer; "
        "each request names the reward (function or entrypoint).",
    )

    _rules = enforce(*_REWARD_RULES, _EXTERNAL_PARAMS_RULE)

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

        value: Any
        try:
            check_reward(self.function, self.params)
        except UnknownRewardError as exc:
            field, value, message = "function", self.function, str(exc)
        except ValueError as exc:
            field, value, message = "params", self.params, str(exc)
        else:
            return self
        raise named_check_error(field, value, message)
