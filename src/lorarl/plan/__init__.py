"""The job plan: a pure function from a LoRARLJob to the processes that run it."""

from lorarl.plan.addressing import ClusterAddressing, LocalAddressing
from lorarl.plan.build import plan
from lorarl.plan.model import ContainerPlan, JobPlan, ReplicaPlan, RolePlan, SyncPlan

__all__ = [
    "ClusterAddressing",
    "ContainerPlan",
    "JobPlan",
    "LocalAddressing",
    "ReplicaPlan",
    "RolePlan",
    "SyncPlan",
    "plan",
]
