"""The few Kubernetes core types a job spec embeds (kept minimal and schema-exact)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lorarl.api.base import ApiModel

Quantity = int | str


class SecretKeySelector(ApiModel):
    name: str = Field(min_length=1, description="Name of the Secret in the job's namespace.")
    key: str = Field(min_length=1, description="Key within the Secret.")
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


class ResourceRequirements(ApiModel):
    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Minimum resources (cpu, memory, ...) per pod."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Maximum resources per pod. GPUs are added by lorarl."
    )


class Toleration(ApiModel):
    key: str | None = Field(default=None, description="Taint key the toleration applies to.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (default Equal)."
    )
    value: str | None = Field(default=None, description="Taint value to match with Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated."
    )


class VolumeClaim(ApiModel):
    claim_name: str = Field(min_length=1, description="PersistentVolumeClaim to mount.")
    mount_path: str = Field(pattern=r"^/", description="Absolute path to mount the claim at.")
    read_only: bool = Field(default=False, description="Mount read-only.")
