"""The few Kubernetes core types a job spec embeds (kept minimal and schema-exact)."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from lorarl.api.base import MAX_INT, MAX_SECONDS, ApiModel
from lorarl.api.rules import Rule, enforce, rules_schema_extra

# The API server's grammars for what the children carry, so a job it would refuse in a Pod is
# refused at `kubectl apply` (and by `lorarl validate`) instead of by every pod creation.
# A non-negative resource.Quantity (resources are never negative).
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
QUALIFIED_NAME = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"
)
CONFIG_KEY = r"^[-._a-zA-Z0-9]+$"


def _quantity(value: Any) -> int | str:
    """One clear error instead of one per union member."""
    ok_int = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT
    if ok_int or (isinstance(value, str) and re.fullmatch(QUANTITY_PATTERN, value)):
        return value
    raise PydanticCustomError(
        "quantity", "must be a Kubernetes quantity such as 500m, 4, 1.5 or 16Gi"
    )


Quantity = Annotated[
    int | str,
    PlainValidator(_quantity),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": MAX_INT},
                {"type": "string", "pattern": QUANTITY_PATTERN},
            ]
        }
    ),
]
ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN)]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]
GPU_RESOURCE = "nvidia.com/gpu"
STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage")
# Container resources: a standard name, hugepages-<size>, or a domain-qualified extended name.
_RESOURCE_NAME = (
    r"^(hugepages-[A-Za-z0-9.]+"
    r"|[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$"
)
_SUFFIX = {
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
    "P": Decimal("1e15"), "E": Decimal("1e18"),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
    "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}  # fmt: skip


def quantity_value(q: int | str) -> Decimal:
    """A resource.Quantity as a number (`500m` -> 0.5, `1Gi` -> 1073741824, `1e3` -> 1000)."""
    if isinstance(q, int):
        return Decimal(q)
    match = re.fullmatch(r"\+?([0-9]*\.?[0-9]*)(.*)", q)
    if match is None:  # a line break: the Quantity pattern refuses it before this is called
        raise ValueError(f"not a quantity: {q!r}")
    number, suffix = match.group(1), match.group(2)
    if suffix in _SUFFIX:
        return Decimal(number) * _SUFFIX[suffix]
    return Decimal(number + suffix)  # decimal exponent: 1e3, 2E-1


class SecretKeySelector(ApiModel):
    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        description="Name of the Secret in the job's namespace.",
    )
    key: str = Field(
        min_length=1, max_length=253, pattern=CONFIG_KEY, description="Key within the Secret."
    )
    optional: bool | None = Field(default=None, description="Allow the Secret or key to be absent.")


class EnvVarSource(ApiModel):
    secret_key_ref: SecretKeySelector = Field(
        description="Read the value from a Secret (the only source allowed: secrets never "
        "appear in the manifest)."
    )


class EnvVar(ApiModel):
    name: str = Field(
        min_length=1,
        pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
        description="Environment variable name. Names lorarl sets itself are reserved.",
    )
    value: str | None = Field(default=None, description="Literal value.")
    value_from: EnvVarSource | None = Field(default=None, description="Value from a Secret key.")


def _resource_names_cel(field: str) -> str:
    standard = "[" + ", ".join(f"'{n}'" for n in STANDARD_RESOURCES) + "]"
    return f"self.{field}.all(k, k in {standard} || k.matches('{_RESOURCE_NAME}'))"


def _resource_names_ok(names: list[str]) -> bool:
    return all(n in STANDARD_RESOURCES or re.fullmatch(_RESOURCE_NAME, n) for n in names)


_RESOURCE_NAMES_RULE = Rule(
    cel=_resource_names_cel("requests") + " && " + _resource_names_cel("limits"),
    message="resource names must be cpu, memory, ephemeral-storage, hugepages-<size> or a "
    "domain-qualified name such as nvidia.com/gpu",
    check=lambda m: _resource_names_ok([*m.requests, *m.limits]),
)


def _requests_within_limits(m: ResourceRequirements) -> bool:
    for name, request in m.requests.items():
        if name not in m.limits:
            continue
        r, lim = quantity_value(request), quantity_value(m.limits[name])
        if r > lim or ("/" in name and r != lim):  # extended resources cannot be overcommitted
            return False
    return True


# Python only: CEL on the API servers this supports has no quantity arithmetic everywhere; the
# webhook enforces it for the cluster.
_REQUESTS_RULE = Rule(
    cel=None,
    message="each request must be at most its limit (and equal to it for extended resources "
    "such as nvidia.com/gpu)",
    check=_requests_within_limits,
    field="requests",
)


class ResourceRequirements(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_RESOURCE_NAMES_RULE))

    # At most 16 names each: the CEL rule over the names must fit the API server's cost budget.
    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        max_length=16,
        description="Minimum resources (cpu, memory, ...) per pod.",
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        max_length=16,
        description="Maximum resources per pod. GPUs are added by lorarl.",
    )

    _rules = enforce(_RESOURCE_NAMES_RULE, _REQUESTS_RULE)


_EXISTS_RULE = Rule(
    cel="!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
    message="must be empty when operator is Exists",
    check=lambda m: m.operator != "Exists" or not m.value,
    field="value",
)
_TOLERATION_SECONDS_RULE = Rule(
    cel="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
    message="only applies to effect NoExecute",
    check=lambda m: m.toleration_seconds is None or m.effect == "NoExecute",
    field="tolerationSeconds",
)


class Toleration(ApiModel):
    model_config = ConfigDict(
        json_schema_extra=rules_schema_extra(_EXISTS_RULE, _TOLERATION_SECONDS_RULE)
    )

    key: str | None = Field(
        default=None,
        max_length=316,
        pattern=QUALIFIED_NAME,
        description="Taint key the toleration applies to.",
    )
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (default Equal)."
    )
    value: str | None = Field(
        default=None, max_length=63, pattern=LABEL_VALUE, description="Taint value to match."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None,
        ge=0,
        le=MAX_SECONDS,
        description="How long a NoExecute taint is tolerated.",
    )

    _rules = enforce(_EXISTS_RULE, _TOLERATION_SECONDS_RULE)


class VolumeClaim(ApiModel):
    claim_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        description="PersistentVolumeClaim to mount.",
    )
    mount_path: str = Field(pattern=r"^/", description="Absolute path to mount the claim at.")
    read_only: bool = Field(
        default=False,
        description="Mount read-only. model.volume and data.volume are always mounted "
        "read-only; training.volume must stay writable.",
    )
