"""A whole cluster on one machine for end-to-end tests and benchmarks: the real control plane
(harness/cluster/controlplane.py: etcd, API server, controller-manager, scheduler), the process
kubelet as its one Node, and the Helm chart installed with Helm as the README says. The operator
and the status API run as the chart's Deployments: the controller-manager makes their
ReplicaSets and Pods, the scheduler binds them, the kubelet runs them with their ServiceAccount
tokens projected, and the API server calls the webhook through its Service.

Tests reach the status API as a person on the node would, at its Service's ClusterIP.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import yaml

from harness.cluster.controlplane import ControlPlane, control_plane
from harness.cluster.kube_client import KubeClient
from harness.kubelet import Kubelet

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "lorarl"
NS = "lorarl-system"
RELEASE = "lorarl"
Obj = dict[str, Any]
LRJ = "lorarl.dev/v1alpha1/lorarljobs"
COMPONENT = "app.kubernetes.io/component"
# A person allowed to read jobs in `default` by a Role, and one who is not.
READERS = """
apiVersion: v1
kind: ServiceAccount
metadata: {name: job-reader, namespace: default}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: outsider, namespace: default}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: lorarljob-reader, namespace: default}
rules:
  - apiGroups: [lorarl.dev]
    resources: [lorarljobs]
    verbs: [get, list]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: lorarljob-reader, namespace: default}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: lorarljob-reader}
subjects:
  - {kind: ServiceAccount, name: job-reader, namespace: default}
"""


@dataclass
class Cluster:
    cp: ControlPlane
    kube: KubeClient  # the admin's client
    kubelet: Kubelet
    objs: list[Obj]  # the release's manifest
    status_url: str
    reader_token: str
    outsider_token: str

    def kubectl(self, *args: str) -> str:
        return self.cp.kubectl_ok(*args)

    def apply(self, manifest: str) -> str:
        """`kubectl apply -f -`."""
        return self.cp.kubectl_ok("apply", "-f", "-", input=manifest)

    def job(self, name: str, namespace: str = "default") -> Obj | None:
        return self.kube.get(LRJ, namespace, name)

    def metrics(self, name: str, token: str, namespace: str = "default") -> httpx.Response:
        url = f"{self.status_url}/v1/jobs/{namespace}/{name}/metrics"
        return httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10)

    def component_pods(self, component: str) -> list[Obj]:
        """The release's running pods of one component ("operator", "status-api")."""
        pods = self.kube.list_objects("v1/pods", NS, f"{COMPONENT}={component}")
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    def component_log(self, component: str) -> str:
        """The newest log of the component's newest pod (empty if none ran here)."""
        runs = [
            r
            for r in list(self.kubelet.pods.values())
            if r.key.startswith(f"{NS}/")
            and (r.pod["metadata"].get("labels") or {}).get(COMPONENT) == component
        ]
        if not runs:
            return ""
        (container,) = runs[-1].containers
        return container.log_path.read_text(errors="replace") if container.log_path.exists() else ""

    def wait_ready(self, component: str, timeout: float = 120) -> Obj:
        """The component's pod once it is Ready (its readiness probe passes)."""
        deadline = time.monotonic() + timeout
        while True:
            self.kubelet.raise_errors()
            for pod in self.component_pods(component):
                conditions = (pod.get("status") or {}).get("conditions") or []
                if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                    return pod
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{component} not Ready in {timeout:.0f} s: "
                    f"{[p.get('status') for p in self.component_pods(component)]}\n"
                    f"{self.component_log(component)[-4000:]}"
                )
            time.sleep(0.5)


def helm_install(cp: ControlPlane, values: Obj | None = None) -> list[Obj]:
    """`helm install lorarl charts/lorarl -n lorarl-system --create-namespace`; the manifest."""
    config = helm.Config(kubeconfig_path=str(cp.kubeconfig_path), namespace=NS)
    try:
        release = config.install(str(CHART), RELEASE, values or {}, create_namespace=True,
                                 timeout=120)  # fmt: skip
    finally:
        config.close()
    return [d for d in yaml.safe_load_all(release["manifest"]) if d]


@contextmanager
def cluster(tmp: Path, values: Obj | None = None) -> Iterator[Cluster]:
    """Everything up (control plane, kubelet, release, its pods Ready), torn down in reverse."""
    with ExitStack() as stack:
        cp = stack.enter_context(control_plane(tmp / "cp"))
        kube = KubeClient(cp)
        stack.callback(kube.close)
        kubelet = stack.enter_context(Kubelet(cp))
        objs = helm_install(cp, values)
        cp.kubectl_ok("apply", "-f", "-", input=READERS)
        c = Cluster(cp, kube, kubelet, objs, "", kube.token("default", "job-reader"),
                    kube.token("default", "outsider"))  # fmt: skip
        try:
            c.wait_ready("operator")
            c.wait_ready("status-api")
            c.cp.kubectl_ok("-n", NS, "rollout", "status", "deploy/lorarl-operator",
                            "--timeout=120s")  # fmt: skip
        except BaseException:
            print(c.component_log("operator")[-6000:])
            raise
        service = next(o for o in objs if o["kind"] == "Service"
                       and o["metadata"]["labels"].get(COMPONENT) == "status-api")  # fmt: skip
        live = kube.get("v1/services", NS, service["metadata"]["name"])
        assert live is not None
        port = live["spec"]["ports"][0]["port"]
        c.status_url = f"http://{live['spec']['clusterIP']}:{port}"
        yield c


def wait_phase(c: Cluster, name: str, phases: tuple[str, ...], timeout: float) -> Obj:
    """The job once its phase is one of `phases` (kubelet failures surface at once)."""
    deadline = time.monotonic() + timeout
    while True:
        c.kubelet.raise_errors()
        job = c.job(name)
        if job and (job.get("status") or {}).get("phase") in phases:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {name} not {phases} within {timeout:.0f} s: {job}")
        time.sleep(1)


__all__ = ["NS", "Cluster", "cluster", "helm_install", "wait_phase"]
