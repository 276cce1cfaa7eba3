"""The JobPlan: everything a backend needs to materialize a job, and nothing backend-specific."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lorarl.api.base import ApiModel
from lorarl.api.spec.k8s import EnvVar, ResourceRequirements, Toleration

Role = Literal["trainer", "rollout", "reward"]


class VolumePlan(ApiModel):
    name: str
    kind: Literal["pvc", "configMap", "memory", "empty"]  # empty: an emptyDir on disk
    source: str | None = Field(default=None, description="Claim or ConfigMap name.")
    read_only: bool = False


class MountPlan(ApiModel):
    volume: str
    path: str
    read_only: bool = False


class ContainerPlan(ApiModel):
    name: str
    image: str
    command: list[str]
    env: dict[str, str] = Field(default_factory=dict, description="Rendered, reserved names.")
    user_env: list[EnvVar] = Field(default_factory=list, description="From the spec, verbatim.")
    ports: dict[str, int] = Field(default_factory=dict)
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    mounts: list[MountPlan] = Field(default_factory=list)


class ReplicaPlan(ApiModel):
    role: Role
    index: int
    name: str = Field(description="Pod name; also its hostname under the headless Service.")
    host: str = Field(description="Address other replicas use to reach this one.")
    containers: list[ContainerPlan]
    init_containers: list[ContainerPlan] = Field(
        default_factory=list, description="Run to completion, in order, before the containers."
    )


class RolePlan(ApiModel):
    role: Role
    replicas: list[ReplicaPlan]
    volumes: list[VolumePlan] = Field(default_factory=list)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    labels: dict[str, str] = Field(
        default_factory=dict, description="Pod labels of this role beyond the job's own."
    )
    gpus_per_replica: int = 0


class SyncPlan(ApiModel):
    address: str
    port: int
    world_size: int = Field(description="1 sender (trainer rank 0) + one sidecar per engine.")
    backend: Literal["nccl", "gloo"]
    mode: Literal["merged", "adapter"]


class JobPlan(ApiModel):
    name: str
    namespace: str
    service_name: str
    placement: Literal["separate", "colocated"] = Field(
        default="separate", description="colocated: the trainer pods run the engines too."
    )
    config_path: str
    labels: dict[str, str]
    sync: SyncPlan
    roles: list[RolePlan]
    config: dict = Field(description="The fully defaulted job, as every process reads it.")

    def role(self, role: Role) -> RolePlan | None:
        return next((r for r in self.roles if r.role == role), None)
