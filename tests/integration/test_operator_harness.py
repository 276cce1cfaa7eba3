"""Harness for the operator's integration tests: the Kubernetes emulator, the real operator
(`python -m lorarl.operator` in a subprocess, so it can be killed), its webhook over TLS, and a
fake trainer progress endpoint. The tests at the bottom check the harness's own endpoints."""

from __future__ import annotations

import copy
import datetime as dt
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from lorarl.local.ports import free_port
from tests.support.chart_release import wait_for
from tests.support.fake_trainer import FakeTrainer
from tests.support.kube_emulator import KubeApi, http_hook, kube_api

ROOT = Path(__file__).resolve().parents[2]
LRJ = "lorarl.dev/v1alpha1/lorarljobs"
CRD = yaml.safe_load((ROOT / "crds" / "lorarljobs.lorarl.dev.yaml").read_text())
QUICKSTART = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
OPERATOR_NAMESPACE = "lorarl-system"
TIMER_SECONDS = "0.3"


def _podgroup_crd(group: str, version: str) -> dict[str, Any]:
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


PODGROUP_CRDS = [
    _podgroup_crd("scheduling.x-k8s.io", "v1alpha1"),
    _podgroup_crd("scheduling.volcano.sh", "v1beta1"),
]


def write_certs(folder: Path) -> None:
    """A self-signed serving certificate for 127.0.0.1 (what cert-manager would mount)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lorarl-webhook")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "tls.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


@dataclass
class Operator:
    """`python -m lorarl.operator` against the emulator; kill() is a real SIGKILL."""

    kube: KubeApi
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
    kube: KubeApi
    operator: Operator
    trainer: FakeTrainer
    webhook_url: str
    names: list[str] = field(default_factory=list)

    def job(self, name: str) -> dict[str, Any] | None:
        return self.kube.emulator.get(LRJ, "default", name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def pods(self, name: str) -> dict[str, dict[str, Any]]:
        return {
            p["metadata"]["name"]: p
            for p in self.kube.emulator.list_objects(
                "v1/pods", "default", label_selector=f"lorarl.dev/job={name}"
            )
        }

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return self.kube.emulator.create(LRJ, manifest)

    def run_all(self, name: str) -> None:
        """Play the kubelet: every pod of the job that is not yet running starts."""
        for pod_name, pod in self.pods(name).items():
            if (pod.get("status") or {}).get("phase") == "Pending":
                self.kube.set_pod_phase("default", pod_name, "Running")

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
            for e in self.kube.emulator.events("default")
            if e["involvedObject"].get("name") == name
        ]


def quickstart(name: str, **spec_overrides: Any) -> dict[str, Any]:
    manifest = copy.deepcopy(QUICKSTART)
    manifest["metadata"]["name"] = name
    for dotted, value in spec_overrides.items():
        cur = manifest["spec"]
        keys = dotted.split("__")
        for key in keys[:-1]:
            cur = cur.setdefault(key, {})
        cur[keys[-1]] = value
    return manifest


def operator_env(kube: KubeApi, trainer_url: str, cert_dir: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "KUBECONFIG": str(kube.kubeconfig_path),
        "LORARL_TIMER_SECONDS": TIMER_SECONDS,
        "LORARL_PROGRESS_URL": trainer_url,
        "LORARL_PROGRESS_TIMEOUT": "0.5",
        "LORARL_WEBHOOK_CERT_DIR": str(cert_dir),
        "LORARL_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE,
        "LORARL_NAMESPACE": "",
        "HOME": str(kube.workdir),
        **extra,
    }


@contextmanager
def cluster(tmp: Path, *, webhook: bool = True) -> Iterator[Cluster]:
    with (
        kube_api(crds=[CRD, *PODGROUP_CRDS]) as kube,
        FakeTrainer(job="demo", total_steps=20) as trainer,
    ):
        cert_dir = tmp / "certs"
        write_certs(cert_dir)
        op = Operator(
            kube,
            operator_env(kube, trainer.url, cert_dir),
            tmp / "operator.log",
            webhook_port=free_port() if webhook else 0,
        )
        url = f"https://127.0.0.1:{op.webhook_port}/validate-lorarljob"
        if webhook:
            kube.emulator.add_admission_hook(
                http_hook(url), name="validate.lorarljobs.lorarl.dev", resource="lrj"
            )
        op.start()
        try:
            yield Cluster(kube, op, trainer, url)
        except BaseException:
            print(op.logs())
            raise
        finally:
            op.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("operator")) as c:
        yield c


def test_health_and_metrics_endpoints_answer(shared: Cluster) -> None:
    shared.create(quickstart("metered"))
    shared.wait_phase("metered", "Pending")
    assert httpx.get(f"http://127.0.0.1:{shared.operator.health_port}/healthz").text == "ok\n"
    text = shared.operator.metrics()
    assert 'lorarl_jobs{phase="Running"}' in text
    assert "lorarl_reconcile_seconds_bucket" in text
