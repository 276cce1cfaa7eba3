"""Where each process listens: pod DNS names in a cluster, loopback ports locally.

The plan is pure given an Addressing, so both backends share every other decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# Container ports in a cluster (each pod has its own network namespace, so they can repeat).
CLUSTER_PORTS = {
    "master": 29500,  # torch.distributed rendezvous of the trainer group
    "sync": 29600,  # TCP store of the weight-sync group, hosted by trainer rank 0
    "progress": 8080,  # trainer rank 0 progress endpoint
    "engine": 30000,  # SGLang / vLLM HTTP server
    "sidecar": 8001,  # sync sidecar health/status
    "reward": 8000,  # Ray Serve HTTP proxy
}

# Local layout: one contiguous block of ports from a base the runner found free.
_LOCAL_FIXED = {"master": 0, "sync": 1, "progress": 2, "reward": 3}
_LOCAL_PER_ROLLOUT = {"engine": 0, "sidecar": 1}
_LOCAL_ROLLOUT_BASE = 10


class Addressing(Protocol):
    def host(self, job: str, role: str, index: int) -> str: ...

    def port(self, role: str, index: int, name: str) -> int: ...


@dataclass(frozen=True)
class ClusterAddressing:
    def host(self, job: str, role: str, index: int) -> str:
        return f"{job}-{role}-{index}.{job}"

    def port(self, role: str, index: int, name: str) -> int:
        return CLUSTER_PORTS[name]


@dataclass(frozen=True)
class LocalAddressing:
    base_port: int

    def host(self, job: str, role: str, index: int) -> str:
        return "127.0.0.1"

    def port(self, role: str, index: int, name: str) -> int:
        if name in _LOCAL_PER_ROLLOUT:
            return self.base_port + _LOCAL_ROLLOUT_BASE + 2 * index + _LOCAL_PER_ROLLOUT[name]
        return self.base_port + _LOCAL_FIXED[name]

    @staticmethod
    def ports_needed(rollout_replicas: int) -> int:
        return _LOCAL_ROLLOUT_BASE + 2 * rollout_replicas
