"""Synchronous helpers over the real API server for tests: read, write, patch, list, events, and
`set_pod_phase`, which writes a pod's status through `pods/status` as a kubelet would (these tests
run no kubelet: the operator's reactions to pod phases are what they check).

Resources are named `<apiVersion>/<plural>`: `v1/pods`, `lorarl.dev/v1alpha1/lorarljobs`.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

import httpx

from harness.cluster.controlplane import ControlPlane

Obj = dict[str, Any]


def resource_path(resource: str, namespace: str | None, name: str | None = None) -> str:
    api_version, plural = resource.rsplit("/", 1)
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace is not None:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    return f"{base}/{name}" if name is not None else base


class KubeClient:
    """The admin's view of the cluster, for arranging and checking what the code under test
    does. Raises on any answer but the ones a test expects (404 on get is None)."""

    def __init__(self, cp: ControlPlane, namespace: str = "default") -> None:
        self.cp, self.namespace = cp, namespace
        self.http: httpx.Client = cp.http()

    def close(self) -> None:
        self.http.close()

    def kubectl(self, *args: str, **kwargs: Any) -> Any:
        """kubectl as the admin, in this client's namespace unless `args` name one."""
        return self.cp.kubectl("-n", self.namespace, *args, **kwargs)

    def _check(self, reply: httpx.Response, what: str) -> Obj:
        if reply.status_code >= 300:
            raise AssertionError(f"{what}: {reply.status_code} {reply.text[:1000]}")
        return reply.json()

    def get(self, resource: str, namespace: str | None, name: str) -> Obj | None:
        reply = self.http.get(resource_path(resource, namespace, name))
        if reply.status_code == 404:
            return None
        return self._check(reply, f"get {resource} {name}")

    def list_objects(
        self, resource: str, namespace: str | None, label_selector: str | None = None
    ) -> list[Obj]:
        params = {"labelSelector": label_selector} if label_selector else {}
        reply = self.http.get(resource_path(resource, namespace), params=params)
        body = self._check(reply, f"list {resource}")
        # Items of a list carry no apiVersion/kind on the wire; kubectl adds them, so do we.
        kind = str(body.get("kind", "")).removesuffix("List")
        return [{"apiVersion": body.get("apiVersion"), "kind": kind, **i} for i in body["items"]]

    def create(self, resource: str, obj: Obj, namespace: str | None = None) -> Obj:
        namespace = namespace or (obj.get("metadata") or {}).get("namespace")
        reply = self.http.post(resource_path(resource, namespace), json=obj)
        return self._check(reply, f"create {resource} {obj['metadata'].get('name')}")

    def patch(self, resource: str, namespace: str | None, name: str, body: Obj) -> Obj:
        reply = self.http.patch(
            resource_path(resource, namespace, name),
            json=body,
            headers={"Content-Type": "application/merge-patch+json"},
        )
        return self._check(reply, f"patch {resource} {name}")

    def delete(
        self, resource: str, namespace: str | None, name: str, grace: int | None = None
    ) -> bool:
        params = {"gracePeriodSeconds": str(grace)} if grace is not None else {}
        reply = self.http.delete(resource_path(resource, namespace, name), params=params)
        if reply.status_code == 404:
            return False
        self._check(reply, f"delete {resource} {name}")
        return True

    def events(self, namespace: str) -> list[Obj]:
        return self.list_objects("v1/events", namespace)

    def set_pod_phase(
        self,
        namespace: str,
        name: str,
        phase: str,
        exit_code: int | None = None,
        reason: str | None = None,
        message: str | None = None,
    ) -> Obj:
        """Write the pod's status as its kubelet would: phase, conditions and one status per
        container (terminated with `exit_code`/`reason`/`message` for a finished pod)."""
        pod = self.get("v1/pods", namespace, name)
        if pod is None:
            raise AssertionError(f"pod {namespace}/{name} does not exist")
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        finished = phase in ("Succeeded", "Failed")
        code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
        if finished:
            state: Obj = {
                "terminated": {
                    "exitCode": code,
                    "startedAt": now,
                    "finishedAt": now,
                    "reason": reason or ("Completed" if code == 0 else "Error"),
                }
            }
            if message:
                state["terminated"]["message"] = message
        elif phase == "Running":
            state = {"running": {"startedAt": now}}
        else:
            state = {"waiting": {"reason": reason or "ContainerCreating"}}
        containers = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": phase == "Running",
                "restartCount": 0,
                "started": phase == "Running",
                "state": state,
            }
            for c in pod["spec"]["containers"]
        ]
        ready = "True" if phase == "Running" else "False"
        status: Obj = {
            "phase": phase,
            "conditions": [
                {"type": "Ready", "status": ready, "lastTransitionTime": now},
                {"type": "ContainersReady", "status": ready, "lastTransitionTime": now},
            ],
            "containerStatuses": containers,
            "startTime": (pod.get("status") or {}).get("startTime") or now,
        }
        reply = self.http.patch(
            resource_path("v1/pods", namespace, name) + "/status",
            json={"status": status},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        return self._check(reply, f"status of pod {name}")

    def reader_token(self, namespace: str) -> tuple[str, str, str]:
        """(API URL, a bound service-account token, CA file) for a service account in
        `namespace` that may get and list LoRARLJobs in every namespace (a ClusterRole)."""
        name = "job-reader"
        role = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": f"lorarl-test-{name}"},
            "rules": [
                {"apiGroups": ["lorarl.dev"], "resources": ["lorarljobs"], "verbs": ["get", "list"]}
            ],
        }
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"lorarl-test-{name}-{namespace}"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"lorarl-test-{name}",
            },
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        }
        account = {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": namespace},
        }
        for obj in (account, role, binding):
            self.cp.kubectl_ok("apply", "-f", "-", input=json.dumps(obj))
        return self.cp.url, self.token(namespace, name), str(self.cp.ca_file)

    def token(self, namespace: str, account: str, seconds: int = 3600) -> str:
        """A bound token for a service account (TokenRequest, as a kubelet projects one)."""
        reply = self.http.post(
            resource_path("v1/serviceaccounts", namespace, account) + "/token",
            json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                  "spec": {"expirationSeconds": seconds}},
        )  # fmt: skip
        return str(self._check(reply, f"token for {account}")["status"]["token"])

    def wait_gone(self, resource: str, namespace: str | None, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.get(resource, namespace, name) is not None:
            if time.monotonic() > deadline:
                raise AssertionError(f"{resource} {namespace}/{name} still there after {timeout}s")
            time.sleep(0.2)


__all__ = ["KubeClient", "resource_path"]
