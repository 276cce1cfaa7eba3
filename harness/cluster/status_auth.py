"""Callers of the status API on a real control plane: service accounts `alice` (get and list
LoRARLJobs in team-a), `bob` (list in team-b), `admin` (get and list everywhere), `nobody`, and
`prometheus` (get the non-resource URL /metrics), with bound tokens; the server's own account
(`status-api`, bound to `system:auth-delegator` and allowed to read jobs); jobs a1, a2 (team-a),
b1 (team-b) and c1 (team-c). What the server asked is read back from the audit log.

Its own control plane (`world()`): listings count every LoRARLJob in the cluster."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cluster.controlplane import ControlPlane, control_plane
from harness.cluster.kube_client import KubeClient
from lorarl.server import KubeApi

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "lorarljobs.lorarl.dev.yaml"
PEOPLE, SERVER_NS = "people", "lorarl-system"
CALLERS = ("alice", "bob", "admin", "nobody", "prometheus")
SERVER = f"system:serviceaccount:{SERVER_NS}:status-api"
LRJ = "lorarl.dev/v1alpha1/lorarljobs"


def account(name: str) -> str:
    return f"system:serviceaccount:{PEOPLE}:{name}"


@dataclass
class World:
    cp: ControlPlane
    kube: KubeClient
    tokens: dict[str, str]  # alice, bob, admin, nobody, server

    def api(self, token: str | None = None) -> KubeApi:
        return KubeApi(
            self.cp.url, token=token or self.tokens["server"], verify=str(self.cp.ca_file)
        )

    def server_requests(self, since: int = 0, settle: float = 1.0) -> list[dict[str, Any]]:
        """The server's completed requests after the first `since` (the audit log is written
        as requests complete: `settle` seconds first)."""
        time.sleep(settle)
        return self.cp.audit(SERVER)[since:]

    def jobs_reads(self, since: int = 0) -> dict[str, int]:
        """The server's get/list of LoRARLJobs after `since`, by verb."""
        out = {"get": 0, "list": 0}
        for entry in self.server_requests(since):
            if (entry.get("objectRef") or {}).get("resource") == "lorarljobs":
                out[entry["verb"]] = out.get(entry["verb"], 0) + 1
        return out

    def reviews(self, kind: str) -> list[dict[str, Any]]:
        """The server's completed TokenReviews or SubjectAccessReviews, oldest first."""
        return [
            e for e in self.cp.audit(SERVER) if (e.get("objectRef") or {}).get("resource") == kind
        ]


def apply_objects(cp: ControlPlane, *objs: dict[str, Any]) -> None:
    for obj in objs:
        cp.kubectl_ok("apply", "-f", "-", input=json.dumps(obj))


def rbac(kind: str, name: str, rules: list[dict[str, Any]], namespace: str | None = None) -> list:
    """A Role (or ClusterRole) and its binding to the service account `name` in PEOPLE."""
    meta = {"name": f"lrj-{name}", **({"namespace": namespace} if namespace else {})}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": meta,
            "rules": rules}  # fmt: skip
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": f"{kind}Binding",
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": meta["name"]},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": PEOPLE}],
    }
    return [role, binding]


def jobs_rule(*verbs: str) -> list[dict[str, Any]]:
    return [{"apiGroups": ["lorarl.dev"], "resources": ["lorarljobs"], "verbs": list(verbs)}]


def job_manifest(
    namespace: str, name: str, *, phase: str = "Running", step: int = 5
) -> tuple[dict, dict]:
    spec = {
        "model": {"path": "/models/tiny"},
        "data": {"trainFiles": ["/data/train.jsonl"]},
        "lora": {"rank": 16, "alpha": 32},
        "rollout": {"engine": "vllm", "replicas": 2, "syncMode": "adapter"},
        "training": {"outputDir": "/out", "volume": {"claimName": "out", "mountPath": "/out"}},
    }
    status = {
        "phase": phase,
        "step": step,
        "totalSteps": 100,
        "metrics": {"rewardMean": 0.25},
        "lastSync": {"version": step, "seconds": 0.4, "mode": "adapter"},
        "conditions": [{"type": "Running", "status": "True", "reason": "TrainerReady",
                        "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
    }  # fmt: skip
    obj = {"apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob",
           "metadata": {"name": name, "namespace": namespace}, "spec": spec}  # fmt: skip
    return obj, status


@contextmanager
def world(workdir: Path) -> Iterator[World]:
    """Start the control plane and set up the callers, their rights and the jobs."""
    with control_plane(workdir, scheduler=False) as cp:
        cp.apply_crds(CRD_PATH)
        for ns in (PEOPLE, SERVER_NS, "team-a", "team-b", "team-c"):
            cp.create_namespace(ns)
        kube = KubeClient(cp)
        for name in CALLERS:
            apply_objects(cp, {"apiVersion": "v1", "kind": "ServiceAccount",
                        "metadata": {"name": name, "namespace": PEOPLE}})  # fmt: skip
        apply_objects(cp, {"apiVersion": "v1", "kind": "ServiceAccount",
                    "metadata": {"name": "status-api", "namespace": SERVER_NS}})  # fmt: skip
        apply_objects(cp, *rbac("Role", "alice", jobs_rule("get", "list"), "team-a"))
        apply_objects(cp, *rbac("Role", "bob", jobs_rule("list"), "team-b"))  # may list, not get
        apply_objects(cp, *rbac("ClusterRole", "admin", jobs_rule("get", "list")))
        metrics_rule = [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
        apply_objects(cp, *rbac("ClusterRole", "prometheus", metrics_rule))
        # The server: reviews (system:auth-delegator, as the chart binds it) and reads jobs.
        server_binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "status-api-auth-delegator"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:auth-delegator"},
            "subjects": [{"kind": "ServiceAccount", "name": "status-api", "namespace": SERVER_NS}],
        }  # fmt: skip
        reader = rbac("ClusterRole", "status-api-reader", jobs_rule("get", "list"))
        reader[1]["subjects"][0]["namespace"] = SERVER_NS
        reader[1]["subjects"][0]["name"] = "status-api"
        apply_objects(cp, server_binding, *reader)
        for namespace, name, kw in (
            ("team-a", "a1", {}),
            ("team-a", "a2", {"phase": "Succeeded", "step": 100}),
            ("team-b", "b1", {}),
            ("team-c", "c1", {}),
        ):
            obj, status = job_manifest(namespace, name, **kw)
            kube.create(LRJ, obj)
            kube.http.patch(
                f"/apis/{LRJ.rsplit('/', 1)[0]}/namespaces/{namespace}/lorarljobs/{name}/status",
                json={"status": status},
                headers={"Content-Type": "application/merge-patch+json"},
            ).raise_for_status()
        tokens = {n: kube.token(PEOPLE, n) for n in CALLERS}
        tokens["server"] = kube.token(SERVER_NS, "status-api")
        yield World(cp, kube, tokens)
        kube.close()


__all__ = [
    "CALLERS",
    "LRJ",
    "PEOPLE",
    "SERVER",
    "SERVER_NS",
    "World",
    "account",
    "apply_objects",
    "job_manifest",
    "jobs_rule",
    "rbac",
    "world",
]
