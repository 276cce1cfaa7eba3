"""The process kubelet: a node agent on the API server emulator, over HTTP, in a thread.

Each pass lists Pods, Services, NetworkPolicies and Namespaces; binds new pods to its node and
starts them (volumes -> netns -> policy rules -> containers); reaps and restarts containers; writes
each pod's status when it changes; stops pods that were deleted; keeps DNS records and every
pod's nftables rules current; and collects garbage by ownerReferences (the controller-manager's
job, done here because nothing else would).

Use as a context manager: `stop()` kills every pod and removes every namespace, link, mount and
directory it made, also when the test failed.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .api import Api, NotFound
from .dns import ClusterDns
from .gc import collect_garbage
from .network import (
    STATE_ROOT,
    Bridge,
    leftovers,
    require_namespaces,
    run,
    sweep_stale,
    unmount_under,
)
from .pod import PodRun
from .policy import TABLE, Endpoint, ruleset

Obj = dict[str, Any]
OPERATOR_LABELS = {"app.kubernetes.io/name": "lorarl", "app.kubernetes.io/component": "operator"}


class Kubelet:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        node: str = "process-node",
        host_namespace: str = "lorarl-system",
        host_labels: dict[str, str] | None = None,
        max_grace: float = 5.0,
        period: float = 0.2,
    ) -> None:
        """`host_namespace`/`host_labels`: whom the host's end of the bridge stands for when
        policies are evaluated (by default the operator's pod in the chart's namespace)."""
        require_namespaces()
        sweep_stale()
        self.kid = secrets.token_hex(2)
        self.folder = STATE_ROOT / self.kid
        self.folder.mkdir(parents=True)
        (self.folder / "owner.pid").write_text(str(os.getpid()))
        self.api = Api(url, token)
        self.node = node
        self.max_grace = max_grace
        self.period = period
        self.host_namespace = host_namespace
        self.host_labels = dict(host_labels or OPERATOR_LABELS)
        self.bridge = Bridge(self.kid)
        self.dns = ClusterDns(self.folder, host_namespace)
        self.pods: dict[str, PodRun] = {}
        self.errors: list[str] = []
        # (monotonic time, "namespace/pod", what): admitted, each new phase, deleted, stopped.
        self.events: list[tuple[float, str, str]] = []
        self._reported: dict[str, Obj] = {}
        self._rules: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kubelet-{self.kid}", daemon=True)
        self._last_gc = 0.0

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
        (c,) = [c for c in run.containers if c.name == container]
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
        if self.errors:
            raise AssertionError("the process kubelet failed:\n" + "\n".join(self.errors))

    def start(self) -> Kubelet:
        self._thread.start()
        return self

    def stop(self) -> list[str]:
        """Stop every pod and remove everything; returns what could not be removed (empty)."""
        if self._stop.is_set():
            return leftovers(self.kid)
        self._stop.set()
        self._thread.join(timeout=60)
        for pod in list(self.pods.values()):
            if not pod.stopped.is_set():
                pod.stop(0.5, self.bridge)
        self.bridge.delete()
        self.api.close()
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
            except Exception:  # a broken pass must not go unnoticed: tests call raise_errors
                self.errors.append(traceback.format_exc())
                if len(self.errors) > 20:
                    return
            self._stop.wait(self.period)

    def _pass(self) -> None:
        pods = self.api.items("/api/v1/pods")
        mine = [p for p in pods if p["spec"].get("nodeName") in (None, "", self.node)]
        live = {p["metadata"]["uid"]: p for p in mine}
        for uid, run_ in list(self.pods.items()):
            if uid not in live and not run_.stopping:
                run_.stopping = True
                grace = min(
                    self.max_grace, run_.pod["spec"].get("terminationGracePeriodSeconds", 30)
                )
                threading.Thread(target=self._teardown, args=(run_, grace), daemon=True).start()
        services = self.api.items("/api/v1/services")
        for uid, pod in live.items():
            if uid not in self.pods and not pod["metadata"].get("deletionTimestamp"):
                self._admit(pod)
        ips = {uid: r.net.ip for uid, r in self.pods.items() if r.net and not r.stopping}
        self.dns.publish([r.pod for r in self.pods.values() if not r.stopping], services, ips)
        self._sync_policies()
        for run_ in list(self.pods.values()):
            if run_.stopping:
                continue
            if run_.waiting_to_start() and time.monotonic() >= run_.tried + 1.0:
                run_.tried = time.monotonic()
                self._try_start(run_)
            run_.step()
            self._report(run_)
        if time.monotonic() - self._last_gc > 1.0:
            self._last_gc = time.monotonic()
            collect_garbage(self.api)

    def _admit(self, pod: Obj) -> None:
        meta = pod["metadata"]
        older = [r for r in self.pods.values() if r.key == f"{meta['namespace']}/{meta['name']}"]
        if any(not r.stopped.is_set() for r in older):
            return  # the previous pod of that name is still being torn down
        if not pod["spec"].get("nodeName"):
            path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            if self.api.patch(path, {"spec": {"nodeName": self.node}}) is None:
                return
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
            run_.create_containers(self.api, hosts)
            # Rules before the first process: a policy that blocks must block from the start.
            self._sync_policies()
        else:
            run_.retry_config(self.api)
        run_.start_containers()

    def _teardown(self, run_: PodRun, grace: float) -> None:
        self.events.append((time.monotonic(), run_.key, "deleted"))
        try:
            run_.stop(grace, self.bridge)
        except Exception:
            self.errors.append(traceback.format_exc())
        finally:
            self.dns.forget(run_.uid)
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

    # -- NetworkPolicy -------------------------------------------------------------------------
    def _sync_policies(self) -> None:
        policies = self.api.items("/apis/networking.k8s.io/v1/networkpolicies")
        namespaces = {
            n["metadata"]["name"]: n["metadata"].get("labels") or {}
            for n in self.api.items("/api/v1/namespaces")
        }
        running = [r for r in self.pods.values() if r.net is not None and not r.stopping]
        host = Endpoint(self.host_namespace, self.host_labels, self.host_ip)
        endpoints = [host, *(e for r in running if (e := r.endpoint()) is not None)]
        for r in running:
            rules = ruleset(r.endpoint(), policies, endpoints, namespaces)
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
