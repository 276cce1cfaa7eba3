"""The kubelet's Node: registered as a real kubelet registers it, kept alive by its Lease.

The Node carries the capacity the scheduler places pods against (cpu, memory, pods and a fake
`nvidia.com/gpu`, so GPU-requesting pods are scheduled, not refused; the processes still run on
CPU) and a Ready condition. A heartbeat thread renews the Lease in `kube-node-lease` and the Ready
condition's heartbeat, so the controller-manager's node lifecycle controller never taints the node
`unreachable`. Everything goes through the node's own credentials (`system:node:<name>`), which
the Node authorizer and NodeRestriction admit only for this node's objects.
"""

from __future__ import annotations

import datetime
import platform
import threading
from collections.abc import Mapping

import httpx

from .api import Api, NotFound

DEFAULT_CAPACITY = {"cpu": "32", "memory": "128Gi", "pods": "110", "nvidia.com/gpu": "8"}
LEASE_SECONDS = 40
RENEW_EVERY = 5.0


def _now(micro: bool = False) -> str:
    stamp = datetime.datetime.now(datetime.UTC)
    if micro:
        return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")


def conditions() -> list[dict[str, str]]:
    stamp = _now()
    healthy = [
        ("MemoryPressure", "KubeletHasSufficientMemory"),
        ("DiskPressure", "KubeletHasNoDiskPressure"),
        ("PIDPressure", "KubeletHasSufficientPID"),
    ]
    out = [
        {
            "type": kind,
            "status": "False",
            "reason": reason,
            "lastHeartbeatTime": stamp,
            "lastTransitionTime": stamp,
            "message": "",
        }
        for kind, reason in healthy
    ]
    out.append(
        {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "the process kubelet is posting ready status",
            "lastHeartbeatTime": stamp,
            "lastTransitionTime": stamp,
        }
    )
    return out


def node_object(name: str, host_ip: str, capacity: Mapping[str, str], version: str) -> dict:
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": arch,
            },
        },
        "spec": {},
        "status": {
            "capacity": dict(capacity),
            "allocatable": dict(capacity),
            "conditions": conditions(),
            "addresses": [
                {"type": "InternalIP", "address": host_ip},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": platform.release(),
                "osImage": "lorarl process kubelet",
                "containerRuntimeVersion": "process://0",
                "kubeletVersion": version,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": arch,
            },
        },
    }


class NodeAgent:
    """Registers the Node (again after a restart of the test, replacing a stale one) and keeps
    its Lease and Ready condition fresh until `stop()`."""

    def __init__(
        self, api: Api, name: str, host_ip: str, capacity: Mapping[str, str], version: str
    ) -> None:
        self.api, self.name = api, name
        self.errors: list[str] = []
        self._stop = threading.Event()
        body = node_object(name, host_ip, capacity, version)
        if self.api.create("/api/v1/nodes", body) is None:  # left over: take it over
            self.api.patch(f"/api/v1/nodes/{name}/status", {"status": body["status"]})
        self._thread = threading.Thread(target=self._beat, name=f"node-{name}", daemon=True)

    def start(self) -> None:
        self._renew()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _beat(self) -> None:
        refused = 0
        while not self._stop.wait(RENEW_EVERY):
            try:
                self._renew()
                refused = 0
            except httpx.TransportError:
                continue  # the API server restarting: the next beat retries
            except httpx.HTTPStatusError as exc:
                code = exc.response.status_code
                refused = refused + 1 if code in (401, 403) else 0
                # 429/5xx, or a restarted server refusing until RBAC is loaded: retried
                if refused > 3 or (code not in (401, 403, 429) and code < 500):
                    self.errors.append(f"node heartbeat: {exc!r}")
            except Exception as exc:  # reported by the kubelet's raise_errors
                self.errors.append(f"node heartbeat: {exc!r}")

    def _renew(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        spec = {
            "holderIdentity": self.name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": _now(micro=True),
        }
        try:
            self.api.get(path)
            self.api.patch(path, {"spec": spec})
        except NotFound:
            self.api.create(
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": "kube-node-lease"},
                    "spec": spec,
                },
            )
        self.api.patch(
            f"/api/v1/nodes/{self.name}/status", {"status": {"conditions": conditions()}}
        )
