"""Harness for the operator's integration tests on the real control plane
(harness/cluster/controlplane.py): the real operator (`python -m lorarl.operator` in a subprocess,
so it can be killed) with its validating webhook registered with the API server over TLS, and a
fake trainer progress endpoint. No kubelet runs here: tests write pod phases through
`pods/status`, as a kubelet would. The tests at the bottom check the harness's own endpoints."""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from harness.cluster.controlplane import ControlPlane, wait_for
from harness.cluster.kube_client import KubeClient
from harness.engines.fake_trainer import FakeTrainer
from lorarl.local.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
LRJ = "lorarl.dev/v1alpha1/lorarljobs"
QUICKSTART = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
OPERATOR_NAMESPACE = "lorarl-system"
TIMER_SECONDS = "0.3"
WEBHOOK_PATH = "/validate-lorarljob"


def _podgroup_crd(group: str, version: str) -> dict[str, Any]:
    """A gang scheduler's PodGroup CRD, as far as the operator needs it (the group and kind)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"podgroups.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "podgroups", "singular": "podgroup", "kind": "PodGroup"},
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


def install_podgroup_crd(cp: ControlPlane, group: str, version: str, folder: Path) -> None:
    path = folder / f"podgroups.{group}.json"
    path.write_text(json.dumps(_podgroup_crd(group, version)))
    cp.apply_crds(path)


def remove_podgroup_crd(cp: ControlPlane, group: str) -> None:
    cp.kubectl("delete", "crd", f"podgroups.{group}", "--ignore-not-found", "--wait=true")


def write_certs(cp: ControlPlane, folder: Path) -> None:
    """The webhook's serving certificate for 127.0.0.1, signed by the cluster's CA (what
    cert-manager would mount as tls.crt/tls.key)."""
    cert, key = cp.pki.issue("operator-webhook", "lorarl-webhook", hosts=["127.0.0.1"], server=True)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(cert, folder / "tls.crt")
    shutil.copy(key, folder / "tls.key")


@dataclass
class Operator:
    """`python -m lorarl.operator` against the API server; kill() is a real SIGKILL."""

    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    health_port: int = 0
    metrics_port: int = 0
    webhook_port: int = 0

    def start(self) -> Operator:
        self.health_port, self.metrics_port = free_port(), free_port()
        env = {
            **self.env,
            "LORARL_HEALTH_PORT": str(self.health_port),
            "LORARL_METRICS_PORT": str(self.metrics_port),
            "LORARL_WEBHOOK_PORT": str(self.webhook_port),
        }
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lorarl.operator"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        wait_for(self._healthy, 30, "operator /healthz")
        if self.webhook_port:
            wait_for(self._webhook_up, 15, "webhook port")
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited {self.proc.returncode}:\n{self.logs()}")
        try:
            return (
                httpx.get(f"http://127.0.0.1:{self.health_port}/healthz", timeout=1).status_code
                == 200
            )
        except httpx.HTTPError:
            return False

    def _webhook_up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.webhook_port), timeout=0.5):
                return True
        except OSError:
            return False

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Cluster:
    kube: KubeClient
    operator: Operator
    trainer: FakeTrainer
    webhook_url: str
    namespace: str = "default"
    names: list[str] = field(default_factory=list)

    def job(self, name: str) -> dict[str, Any] | None:
        return self.kube.get(LRJ, self.namespace, name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def pods(self, name: str) -> dict[str, dict[str, Any]]:
        """The job's pods that are not terminating (what a kubelet would still run)."""
        return {
            p["metadata"]["name"]: p
            for p in self.kube.list_objects(
                "v1/pods", self.namespace, label_selector=f"lorarl.dev/job={name}"
            )
            if not p["metadata"].get("deletionTimestamp")
        }

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return self.kube.create(LRJ, manifest, namespace=self.namespace)

    def run_all(self, name: str) -> None:
        """Play the kubelet: every pod of the job that is not yet running starts."""
        for pod_name, pod in self.pods(name).items():
            if (pod.get("status") or {}).get("phase") == "Pending":
                self.kube.set_pod_phase(self.namespace, pod_name, "Running")

    def wait_phase(self, name: str, phase: str, timeout: float = 15.0) -> dict[str, Any]:
        wait_for(
            lambda: self.status(name).get("phase") == phase,
            timeout,
            f"{name} phase {phase} (now {self.status(name).get('phase')})",
        )
        return self.status(name)

    def wait_pods(self, name: str, expected: set[str], timeout: float = 15.0) -> None:
        wait_for(
            lambda: set(self.pods(name)) == expected, timeout, f"{name} pods == {sorted(expected)}"
        )

    def wait_event(
        self, name: str, reason: str, text: str = "", timeout: float = 10.0
    ) -> tuple[str, str, str]:
        """Events are posted asynchronously (kopf's posting queue): wait for one."""
        return wait_for(
            lambda: next((e for e in self.events(name) if e[1] == reason and text in e[2]), None),
            timeout,
            f"event {reason} {text!r} on {name}",
        )

    def events(self, name: str) -> list[tuple[str, str, str]]:
        return [
            (e.get("type", ""), e["reason"], e.get("message", ""))
            for e in self.kube.events(self.namespace)
            if e["involvedObject"].get("name") == name
        ]


def quickstart(name: str, **spec_overrides: Any) -> dict[str, Any]:
    manifest = copy.deepcopy(QUICKSTART)
    manifest["metadata"]["name"] = name
    # A folder of its own on the shared claim: the webhook refuses two live jobs in one.
    training = manifest["spec"]["training"]
    training["outputDir"] = f"{training['volume']['mountPath'].rstrip('/')}/{name}"
    for dotted, value in spec_overrides.items():
        cur = manifest["spec"]
        keys = dotted.split("__")
        for key in keys[:-1]:
            cur = cur.setdefault(key, {})
        cur[keys[-1]] = value
    return manifest


def operator_env(
    cp: ControlPlane, trainer_url: str, cert_dir: Path, namespace: str, **extra: str
) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")},
        "KUBECONFIG": str(cp.kubeconfig_path),
        "LORARL_TIMER_SECONDS": TIMER_SECONDS,
        "LORARL_PROGRESS_URL": trainer_url,
        "LORARL_PROGRESS_TIMEOUT": "0.5",
        "LORARL_WEBHOOK_CERT_DIR": str(cert_dir),
        "LORARL_WEBHOOK_ADDR": "127.0.0.1",
        "LORARL_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE,
        "LORARL_NAMESPACE": namespace,  # one operator per namespace: tests share the server
        "HOME": str(cp.workdir),
        **extra,
    }


def register_webhook(cp: ControlPlane, url: str, cert_dir: Path, namespace: str) -> str:
    """The operator's ValidatingWebhookConfiguration (as the chart's), calling `url`, for jobs
    in `namespace`; returns its name."""
    name = f"lorarl-test-{namespace}"
    config = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "validate.lorarljobs.lorarl.dev",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": 10,
                "clientConfig": {
                    "url": url,
                    "caBundle": base64.b64encode(cp.ca_file.read_bytes()).decode(),
                },
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "rules": [
                    {
                        "apiGroups": ["lorarl.dev"],
                        "apiVersions": ["v1alpha1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["lorarljobs"],
                    }
                ],
            }
        ],
    }
    cp.kubectl_ok("apply", "-f", "-", input=json.dumps(config))
    return name


@contextmanager
def cluster(
    cp: ControlPlane, tmp: Path, *, namespace: str = "default", webhook: bool = True
) -> Iterator[Cluster]:
    """The operator for `namespace` on the shared control plane (CRDs installed)."""
    cp.apply_crds(ROOT / "crds" / "lorarljobs.lorarl.dev.yaml")
    for ns in {namespace, OPERATOR_NAMESPACE}:
        if cp.kubectl("get", "namespace", ns).returncode != 0:
            cp.create_namespace(ns)
    kube = KubeClient(cp, namespace)
    with FakeTrainer(job="demo", total_steps=20) as trainer:
        cert_dir = tmp / "certs"
        write_certs(cp, cert_dir)
        op = Operator(
            operator_env(cp, trainer.url, cert_dir, namespace),
            tmp / "operator.log",
            webhook_port=free_port() if webhook else 0,
        )
        url = f"https://127.0.0.1:{op.webhook_port}{WEBHOOK_PATH}"
        op.start()
        hook = register_webhook(cp, url, cert_dir, namespace) if webhook else None
        try:
            if hook:
                _wait_webhook_active(kube, namespace)
            yield Cluster(kube, op, trainer, url, namespace)
        except BaseException:
            print(op.logs())
            raise
        finally:
            if hook:
                cp.kubectl("delete", "validatingwebhookconfiguration", hook)
            op.stop()
            kube.close()


def _wait_webhook_active(kube: KubeClient, namespace: str, timeout: float = 15) -> None:
    """A new webhook configuration takes effect once the API server's informer has it: send a
    job only the webhook refuses (a Python-only rule; dry run) until its words come back."""
    bad = quickstart("webhook-probe", reward={"function": "no_such_reward"})
    path = f"/apis/lorarl.dev/v1alpha1/namespaces/{namespace}/lorarljobs"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = kube.http.post(path, params={"dryRun": "All"}, json=bad)
        if "validate.lorarljobs.lorarl.dev" in reply.text:
            return
        time.sleep(0.2)
    raise AssertionError("the operator's webhook never answered the API server")


@pytest.fixture(scope="module")
def shared(
    cp: ControlPlane, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """One operator per test module, in a namespace of the module's own (modules share the
    control plane; job names repeat across them)."""
    folder = tmp_path_factory.mktemp("operator")
    install_podgroup_crd(cp, "scheduling.x-k8s.io", "v1alpha1", folder)
    namespace = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")[:50]
    with cluster(cp, folder, namespace=namespace) as c:
        yield c


def test_health_and_metrics_endpoints_answer(shared: Cluster) -> None:
    shared.create(quickstart("metered"))
    shared.wait_phase("metered", "Pending")
    assert httpx.get(f"http://127.0.0.1:{shared.operator.health_port}/healthz").text == "ok\n"
    text = shared.operator.metrics()
    assert 'lorarl_jobs{phase="Running"}' in text
    assert "lorarl_reconcile_seconds_bucket" in text
