"""The process kubelet: a Node of the real test cluster (harness/cluster/controlplane.py), in a
thread.

It registers its Node and renews its Lease (node.py) and talks to the API server as
`system:node:<name>`, so the Node authorizer and NodeRestriction judge every request it makes.
Each pass lists the pods the scheduler bound to it and starts new ones (volumes -> netns ->
service and policy rules -> init containers, one at a time -> containers); reaps and restarts
containers; writes each pod's status through `pods/status` when it changes; and honours
graceful deletion: a pod with a deletionTimestamp gets SIGTERM, its grace period (capped by
`max_grace`), SIGKILL, and then the kubelet's own final DELETE, as a real kubelet ends it.

What a cluster's node agents besides the kubelet do runs here too, under an identity of their
own with only the reads and writes they need (a ClusterRole made at start): the CNI's
NetworkPolicy rules (policy.py), kube-proxy's service rules (proxy.py), cluster DNS as hosts
files (dns.py), and a local-path provisioner that binds each pending PersistentVolumeClaim to a
hostPath PersistentVolume on this node (`claim_dir`).

Use as a context manager: `stop()` kills every pod and removes every namespace, link, mount,
rule and directory it made, and its Node, also when the test failed.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

from . import proxy
from .api import Api, NotFound
from .containers import service_env
from .dns import ClusterDns
from .network import (
    HOST_TABLE,
    STATE_ROOT,
    Bridge,
    leftovers,
    require_namespaces,
    run,
    sweep_stale,
    unmount_under,
)
from .node import DEFAULT_CAPACITY, NodeAgent
from .pod import PodRun
from .policy import TABLE, ruleset

Obj = dict[str, Any]
AGENT_ROLE = "lorarl-test:node-agents"
REFUSALS_TOLERATED = 50  # passes (~10 s) a restarted API server may refuse while RBAC loads
AGENT_RULES = [
    {"apiGroups": [""], "resources": ["pods", "namespaces", "services",
                                      "persistentvolumeclaims"],
     "verbs": ["get", "list"]},
    {"apiGroups": [""], "resources": ["persistentvolumes"],
     "verbs": ["get", "list", "create", "delete"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["delete"]},  # the node leaving, at stop
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["list"]},
]  # fmt: skip


class Cluster(Protocol):
    """What the kubelet needs of the control plane (harness.cluster.controlplane.ControlPlane)."""

    url: str
    version: str

    @property
    def ca_file(self) -> Path: ...

    def issue_client(
        self, name: str, common_name: str, groups: Sequence[str]
    ) -> tuple[Path, Path]: ...

    def http(self) -> Any: ...


class Kubelet:
    def __init__(
        self,
        cluster: Cluster,
        *,
        node: str = "process-node",
        capacity: dict[str, str] | None = None,
        max_grace: float = 5.0,
        period: float = 0.2,
    ) -> None:
        require_namespaces()
        sweep_stale()
        self.kid = secrets.token_hex(2)
        self.folder = STATE_ROOT / self.kid
        self.folder.mkdir(parents=True)
        (self.folder / "owner.pid").write_text(str(os.getpid()))
        self.node = node
        node_cert = cluster.issue_client(f"kubelet-{node}", f"system:node:{node}", ["system:nodes"])
        self.api = Api(cluster.url, cluster.ca_file, node_cert)
        self.agents = Api(cluster.url, cluster.ca_file, _agent_identity(cluster, node))
        self.api_port = urlsplit(cluster.url).port or 443
        self.max_grace = max_grace
        self.period = period
        self.bridge = Bridge(self.kid)
        self.host_table = HOST_TABLE.format(kid=self.kid)
        self.dns = ClusterDns(self.folder)
        self.pods: dict[str, PodRun] = {}
        self.errors: list[str] = []
        # (monotonic time, "namespace/pod", what): admitted, each new phase, deleted, stopped.
        self.events: list[tuple[float, str, str]] = []
        self._reported: dict[str, Obj] = {}
        self._rules: dict[str, str] = {}
        self._svc_rules: dict[str, str] = {}
        self._services: list[Obj] = []
        self._routes: list[proxy.Route] = []
        self._volumes: set[str] = set()  # PersistentVolumes this node's provisioner made
        self.api_outages = 0  # passes cut short by an unavailable API server
        self._refused = 0  # passes refused in a row (401/403)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kubelet-{self.kid}", daemon=True)
        self.node_agent = NodeAgent(self.api, node, self.bridge.host_ip,
                                    capacity or DEFAULT_CAPACITY, cluster.version)  # fmt: skip

    # -- public --------------------------------------------------------------------------------
    @property
    def host_ip(self) -> str:
        return self.bridge.host_ip

    @property
    def hosts_file(self) -> Path:
        """Cluster DNS for processes on the host (bind it at /etc/hosts in their mount ns)."""
        return self.dns.host_file

    def claim_dir(self, namespace: str, claim: str) -> Path:
        """The directory backing PersistentVolumeClaim `claim` (created on first use)."""
        path = self.folder / "claims" / namespace / claim
        path.mkdir(parents=True, exist_ok=True)
        return path

    def pod(self, namespace: str, name: str) -> PodRun | None:
        """The newest run of a pod by name (a deleted one stays until the next pod of that name)."""
        runs = [p for p in list(self.pods.values()) if p.key == f"{namespace}/{name}"]
        return runs[-1] if runs else None

    def log_path(self, namespace: str, name: str, container: str) -> Path:
        run = self.pod(namespace, name)
        assert run is not None, f"no pod {namespace}/{name} ran here"
        (c,) = [c for c in [*run.init_containers, *run.containers] if c.name == container]
        return c.log_path

    def logs(self, namespace: str, name: str, container: str) -> str:
        return self.log_path(namespace, name, container).read_text(errors="replace")

    def wait(self, check: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            self.raise_errors()
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:.0f} s")
            time.sleep(0.1)

    def raise_errors(self) -> None:
        errors = [*self.errors, *self.node_agent.errors]
        if errors:
            raise AssertionError("the process kubelet failed:\n" + "\n".join(errors))

    def start(self) -> Kubelet:
        self.node_agent.start()
        self._thread.start()
        return self

    def stop(self) -> list[str]:
        """Stop every pod and remove everything; returns what could not be removed (empty)."""
        if self._stop.is_set():
            return leftovers(self.kid)
        self._stop.set()
        self._thread.join(timeout=60)
        self.node_agent.stop()
        for pod in list(self.pods.values()):
            if not pod.stopped.is_set():
                pod.stop(0.5, self.bridge)
        run("nft", "delete", "table", "ip", self.host_table, check=False)
        self.bridge.delete()
        with contextlib.suppress(Exception):  # the API server may be gone already
            for pv in self._volumes:
                self.agents.delete(f"/api/v1/persistentvolumes/{pv}")
            self.agents.delete(f"/api/v1/nodes/{self.node}")
        self.api.close()
        self.agents.close()
        unmount_under(self.folder)
        run("rm", "-rf", "--one-file-system", str(self.folder), check=False)
        return leftovers(self.kid)

    def __enter__(self) -> Kubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._pass()
                self._refused = 0
            except (httpx.TransportError, httpx.HTTPStatusError) as exc:
                # The API server restarting (or etcd under it): a kubelet keeps its pods
                # running and retries, as a real one does. A restarted server refuses (401/403)
                # until its authorizer has loaded RBAC again: only a refusal that lasts is one.
                self.api_outages += 1
                refused = isinstance(exc, httpx.HTTPStatusError) and not _unavailable(exc)
                self._refused = self._refused + 1 if refused else 0
                if self._refused > REFUSALS_TOLERATED:
                    self.errors.append(traceback.format_exc())
                    if len(self.errors) > 20:
                        return
            except Exception:  # a broken pass must not go unnoticed: tests call raise_errors
                self.errors.append(traceback.format_exc())
                if len(self.errors) > 20:
                    return
            self._stop.wait(self.period)

    def _pass(self) -> None:
        mine = self.api.items(f"/api/v1/pods?fieldSelector=spec.nodeName%3D{self.node}")
        live = {p["metadata"]["uid"]: p for p in mine}
        for uid, run_ in list(self.pods.items()):
            pod = live.get(uid)
            if run_.stopping or (pod is not None and not pod["metadata"].get("deletionTimestamp")):
                continue
            run_.stopping = True
            spec_grace = run_.pod["spec"].get("terminationGracePeriodSeconds", 30)
            grace = (pod or {}).get("metadata", {}).get("deletionGracePeriodSeconds", spec_grace)
            threading.Thread(
                target=self._teardown, args=(run_, min(self.max_grace, grace), pod is not None),
                daemon=True,
            ).start()  # fmt: skip
        self._services = self.agents.items("/api/v1/services")
        slices = self.agents.items("/apis/discovery.k8s.io/v1/endpointslices")
        self._routes = proxy.routes(self._services, slices, (self.bridge.host_ip, self.api_port))
        for uid, pod in live.items():
            if uid not in self.pods and not pod["metadata"].get("deletionTimestamp"):
                self._admit(pod)
        ips = {uid: r.net.ip for uid, r in self.pods.items() if r.net and not r.stopping}
        self.dns.publish([r.pod for r in self.pods.values() if not r.stopping], self._services, ips)
        self._sync_policies()
        self._sync_services()
        for run_ in list(self.pods.values()):
            if run_.stopping:
                continue
            if run_.waiting_to_start() and time.monotonic() >= run_.tried + 1.0:
                run_.tried = time.monotonic()
                self._try_start(run_)
            run_.step()
            run_.probe()
            self._report(run_)
        self._provision_claims()

    def _admit(self, pod: Obj) -> None:
        meta = pod["metadata"]
        older = [r for r in self.pods.values() if r.key == f"{meta['namespace']}/{meta['name']}"]
        if any(not r.stopped.is_set() for r in older):
            return  # the previous pod of that name is still being torn down
        folder = self.folder / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        folder.mkdir(parents=True)
        self.pods[meta["uid"]] = PodRun(pod=pod, folder=folder)
        self.events.append((time.monotonic(), f"{meta['namespace']}/{meta['name']}", "admitted"))
        self._try_start(self.pods[meta["uid"]])

    def _try_start(self, run_: PodRun) -> None:
        """Sandbox, rules, containers; a pod waiting on a volume (a claim not there yet) or a
        container waiting on its config (a Secret not there yet) is retried every pass."""
        if run_.net is None:
            run_.sandbox(self.api, self.bridge, self.claim_dir)
            if run_.net is None:
                return
            hosts = self.dns.pod_file(run_.uid, run_.pod, run_.net.ip, run_.folder / "hosts")
            links = run_.pod["spec"].get("enableServiceLinks", True)
            env = service_env(run_.pod["metadata"]["namespace"], self._services, links)
            run_.create_containers(self.api, hosts, env)
            # Rules before the first process: a policy that blocks must block from the start,
            # and the API server's Service must answer the first request.
            self._sync_policies()
            self._sync_services()
        else:
            run_.retry_config(self.api)
        run_.start_containers()

    def _teardown(self, run_: PodRun, grace: float, final_delete: bool) -> None:
        """Stop the pod; then, if the API server still has it (a graceful deletion), remove it
        for good: the kubelet's DELETE with grace 0 for this uid ends every pod's life."""
        self.events.append((time.monotonic(), run_.key, "deleted"))
        try:
            run_.stop(grace, self.bridge)
            if final_delete:
                meta = run_.pod["metadata"]
                self.api.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                gracePeriodSeconds=0, preconditions={"uid": run_.uid})  # fmt: skip
        except Exception:
            self.errors.append(traceback.format_exc())
        finally:
            self.dns.forget(run_.uid)
            self._svc_rules.pop(run_.uid, None)
            run_.stopped.set()
            self.events.append((time.monotonic(), run_.key, "stopped"))

    def _report(self, run_: PodRun) -> None:
        status = run_.status(self.host_ip)
        if status["phase"] == "Running" and run_.running_at is None:
            run_.running_at = time.monotonic()
        before = self._reported.get(run_.uid)
        if before == status:
            return
        meta = run_.pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        try:
            live = self.api.get(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}")
        except NotFound:
            return  # deleted since this pass listed it: the watch tears it down
        if live["metadata"]["uid"] != run_.uid:
            return  # a newer pod of the same name; ours is gone
        if self.api.patch(path, {"status": status}) is not None:
            self._reported[run_.uid] = status
            if before is None or before["phase"] != status["phase"]:
                self.events.append((time.monotonic(), run_.key, status["phase"]))

    # -- Services (kube-proxy's part) -----------------------------------------------------------
    def _sync_services(self) -> None:
        host_routes = [r for r in self._routes if r.targets != ((self.host_ip, self.api_port),)]
        host = proxy.ruleset(
            self.host_table,
            self.bridge.name,
            host_routes,
            [proxy.api_prerouting(self.bridge.name, self.host_ip, self.api_port)],
        )
        if self._svc_rules.get("host") != host:
            run("nft", "-f", "-", input=host)
            self._svc_rules["host"] = host
        pod_rules = proxy.ruleset(proxy.TABLE, "eth0", self._routes)
        for r in list(self.pods.values()):
            if r.net is None or r.stopping or self._svc_rules.get(r.uid) == pod_rules:
                continue
            run("ip", "netns", "exec", r.net.netns, "nft", "-f", "-", input=pod_rules)
            self._svc_rules[r.uid] = pod_rules  # fmt: skip

    # -- PersistentVolumeClaims (a local-path provisioner's part) -------------------------------
    def _provision_claims(self) -> None:
        for claim in self.agents.items("/api/v1/persistentvolumeclaims"):
            meta, spec = claim["metadata"], claim.get("spec") or {}
            name = f"lrk-{meta['uid']}"
            if spec.get("volumeName") or name in self._volumes or meta.get("deletionTimestamp"):
                continue
            size = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
            volume: Obj = {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": name, "labels": {"lorarl.dev/test-node": self.node}},
                "spec": {
                    "capacity": {"storage": size},
                    "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "hostPath": {"path": str(self.claim_dir(meta["namespace"], meta["name"]))},
                    "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                 "namespace": meta["namespace"], "name": meta["name"],
                                 "uid": meta["uid"]},
                },
            }  # fmt: skip
            if spec.get("storageClassName"):
                volume["spec"]["storageClassName"] = spec["storageClassName"]
            self.agents.create("/api/v1/persistentvolumes", volume)
            self._volumes.add(name)

    # -- NetworkPolicy (the CNI's part) ---------------------------------------------------------
    def _sync_policies(self) -> None:
        policies = self.agents.items("/apis/networking.k8s.io/v1/networkpolicies")
        namespaces = {
            n["metadata"]["name"]: n["metadata"].get("labels") or {}
            for n in self.agents.items("/api/v1/namespaces")
        }
        running = [r for r in self.pods.values() if r.net is not None and not r.stopping]
        endpoints = [e for r in running if (e := r.endpoint()) is not None]
        for r in running:
            rules = ruleset(r.endpoint(), policies, endpoints, namespaces, self.host_ip)
            if self._rules.get(r.uid) != rules:
                run("ip", "netns", "exec", r.net.netns, "nft", "-f", "-", input=rules)
                self._rules[r.uid] = rules

    def rules(self, namespace: str, name: str) -> str:
        """The nftables script in force for a pod (for tests and debugging)."""
        pod = self.pod(namespace, name)
        assert pod is not None and pod.uid in self._rules
        return self._rules[pod.uid]

    def dropped(self, namespace: str, name: str, direction: str = "ingress") -> int:
        """Packets the pod's policy rules refused so far."""
        pod = self.pod(namespace, name)
        assert pod is not None and pod.net is not None
        text = run("ip", "netns", "exec", pod.net.netns, "nft", "list", "chain", "inet",
                   TABLE, direction)  # fmt: skip
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", text))


def _agent_identity(cluster: Cluster, node: str) -> tuple[Path, Path]:
    """A client certificate for the node's agents (CNI, kube-proxy, DNS, provisioner), bound to
    a ClusterRole of only what they read and write."""
    user = f"lorarl-test:node-agents:{node}"
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": AGENT_ROLE}, "rules": AGENT_RULES}  # fmt: skip
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": AGENT_ROLE},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": AGENT_ROLE},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
                      "name": "lorarl-test:node-agents"}],
    }  # fmt: skip
    with cluster.http() as http:
        for path, body in (
            ("/apis/rbac.authorization.k8s.io/v1/clusterroles", role),
            ("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding),
        ):
            reply = http.post(path, json=body)
            if reply.status_code not in (201, 409):
                reply.raise_for_status()  # fmt: skip
    return cluster.issue_client(f"agents-{node}", user, ["lorarl-test:node-agents"])


def _unavailable(exc: Exception) -> bool:
    """The API server is down or not ready (connection refused or reset, 429/5xx)."""
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code == 429 or exc.response.status_code >= 500
    return True
