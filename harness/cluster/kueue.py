"""Kueue for real on the test control plane: its controller manager (built from its Go module by
scripts/build_kueue.sh) run as a process with the `pod` integration, its CRDs, and its mutating
and validating webhooks registered with the API server through the `kueue-webhook-service`
Service, whose loopback ClusterIP the manager listens on (the stand-in for kube-proxy's rule).

Kueue's webhooks are cluster-wide and fail closed, so give Kueue a control plane of its own.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from harness.cluster.controlplane import ROOT, ControlPlane, wait_until
from lorarl.local.ports import free_port

GO_MOD = ROOT / "tests" / "cluster" / "kueue" / "go.mod"
NAMESPACE = "kueue-system"
SERVICE = "kueue-webhook-service"
# The webhooks a pod-integration install needs: pods, and Kueue's own kinds.
WANTED_PATHS = re.compile(r"^/(mutate|validate)-(-v1-pod|kueue-x-k8s-io-)")


def pinned_version() -> str:
    match = re.search(r"sigs\.k8s\.io/kueue (v\S+)", GO_MOD.read_text())
    if match is None:
        raise RuntimeError(f"{GO_MOD} pins no sigs.k8s.io/kueue version")
    return match.group(1)


def kueue_dir() -> Path:
    """`LORARL_KUEUE_DIR`, else the build script's default folder; missing is an error naming
    the command that builds it."""
    explicit = os.environ.get("LORARL_KUEUE_DIR")
    path = Path(explicit) if explicit else ROOT / ".cache" / "kueue" / pinned_version()
    if not (os.access(path / "kueue", os.X_OK) and (path / "crds").is_dir()):
        raise FileNotFoundError(
            f"Kueue missing in {path}: run `make kueue` (scripts/build_kueue.sh)"
        )
    return path


def _webhooks(source: Path) -> list[dict[str, Any]]:
    """Kueue's webhook configurations as its kustomization names them (the names its cert
    rotator looks for), pointing at our Service; the rotator fills in caBundle."""
    out = []
    for doc in yaml.safe_load_all(source.read_text()):
        if not doc:
            continue
        doc["metadata"] = {"name": f"kueue-{doc['metadata']['name']}"}
        hooks = []
        for hook in doc["webhooks"]:
            svc = hook["clientConfig"]["service"]
            if not WANTED_PATHS.match(svc.get("path", "")):
                continue
            svc.update(name=SERVICE, namespace=NAMESPACE)
            hooks.append(hook)
        doc["webhooks"] = hooks
        out.append(doc)
    return out


def _crds(src: Path, out: Path) -> list[Path]:
    """Kueue's CRDs with the conversion webhooks its kustomization patches in (the served
    versions convert through Kueue; its cert rotator fills their caBundle)."""
    listed = yaml.safe_load((src / "crd-patches" / "kustomization.yaml").read_text())
    conversions = {}
    for entry in listed.get("patches", []):
        patch = yaml.safe_load((src / "crd-patches" / Path(entry["path"]).name).read_text())
        conversion = patch["spec"]["conversion"]
        conversion["webhook"]["clientConfig"]["service"].update(name=SERVICE, namespace=NAMESPACE)
        conversions[patch["metadata"]["name"]] = conversion
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for path in sorted((src / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["metadata"]["name"] in conversions:
            crd["spec"]["conversion"] = conversions[crd["metadata"]["name"]]
        paths.append(out / f"{path.stem}.json")
        paths[-1].write_text(json.dumps(crd))
    return paths


@contextmanager
def kueue(cp: ControlPlane, workdir: Path) -> Iterator[Path]:
    """Install and run Kueue; yields its log file. Stopped and its webhooks removed on exit."""
    src = kueue_dir()
    workdir.mkdir(parents=True, exist_ok=True)
    if cp.kubectl("get", "namespace", NAMESPACE).returncode != 0:
        cp.create_namespace(NAMESPACE)
    cp.apply_crds(*_crds(src, workdir / "crds"))
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": SERVICE, "namespace": NAMESPACE},
        "spec": {"ports": [{"port": 443, "targetPort": 9443, "protocol": "TCP"}]},
    }
    cp.kubectl_ok("apply", "-f", "-", input=json.dumps(service))
    cluster_ip = json.loads(
        cp.kubectl_ok("get", "service", SERVICE, "-n", NAMESPACE, "-o", "json")
    )["spec"]["clusterIP"]
    # The empty Secret Kueue's install ships (config/components/internalcert): its cert rotator
    # fills it, then writes the serving pair to `certs` and the caBundle into the webhooks.
    name = {"name": "kueue-webhook-server-cert", "namespace": NAMESPACE}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": name}
    cp.kubectl_ok("apply", "-f", "-", input=json.dumps(secret))
    certs = workdir / "certs"  # Kueue's own cert rotator writes its serving pair here
    certs.mkdir(exist_ok=True)
    health = free_port()
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        "metrics": {"bindAddress": "0"},
        # The Service's port on its ClusterIP: where the API server dials the webhooks.
        "webhook": {"port": 443, "host": cluster_ip, "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        # Kueue's default install: it makes its webhook certificate (a Secret), fills the
        # webhook configurations' caBundle and serves with it.
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": SERVICE,
            "webhookSecretName": "kueue-webhook-server-cert",
        },
        "integrations": {"frameworks": ["pod"]},
    }
    config_file = workdir / "kueue-config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    configs = _webhooks(src / "webhook" / "manifests.yaml")
    for doc in configs:
        cp.kubectl_ok("apply", "-f", "-", input=json.dumps(doc))
    log = workdir / "kueue.log"
    env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig_path), "HOME": str(workdir)}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            # The on-demand visibility API server is not used here (it would bind 0.0.0.0:8082).
            [str(src / "kueue"), f"--config={config_file}", "--zap-log-level=2",
             "--feature-gates=VisibilityOnDemand=false"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    stop = threading.Event()
    mount = threading.Thread(
        target=_project_secret, args=(cp, certs, stop), daemon=True, name="kueue-cert-volume"
    )
    mount.start()
    try:
        wait_until(lambda: _healthy(proc, health, log), 120, "Kueue's readiness probe")
        yield log
    finally:
        stop.set()
        for doc in configs:
            cp.kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"], "--ignore-not-found")
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _project_secret(cp: ControlPlane, folder: Path, stop: threading.Event) -> None:
    """The kubelet's Secret volume: Kueue's cert rotator writes its certificate into the Secret
    and waits for the files to appear in its cert dir, as they would in its pod."""
    written: dict[str, bytes] = {}
    url = f"/api/v1/namespaces/{NAMESPACE}/secrets/kueue-webhook-server-cert"
    with cp.http() as http:
        while not stop.wait(0.5):
            try:
                data = (http.get(url).json().get("data")) or {}
            except httpx.HTTPError:
                continue
            for key, value in data.items():
                raw = base64.b64decode(value)
                if written.get(key) != raw:
                    tmp = folder / f".{key}.tmp"
                    tmp.write_bytes(raw)
                    tmp.replace(folder / key)
                    written[key] = raw


def _healthy(proc: subprocess.Popen[bytes], port: int, log: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"kueue exited {proc.returncode}:\n{log.read_text()[-4000:]}")
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


__all__ = ["kueue", "kueue_dir", "pinned_version"]
