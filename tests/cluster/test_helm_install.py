"""`helm install` as the README says, with real Helm (the Helm v4 SDK) into a real API server:
the chart's CRD and every template are accepted, `helm upgrade` works, and the operator, run
exactly as its Deployment says and authenticated as its ServiceAccount with a bound token,
reconciles jobs under the chart's RBAC (checked by the API server's own audit log: no request
denied) while the API server calls its webhook through the chart's Service over TLS.

No kubelet of this cluster runs the Deployment's pod (the process kubelet of tests/support/
kubelet still serves the emulator-based end-to-end tests), so the operator process plays its
pod: the Secret volume is written to a folder, the token comes from TokenRequest as a kubelet's
projected volume would, and the webhook listens on the Service's ClusterIP and port, which
`--service-cluster-ip-range` puts on loopback (the stand-in for kube-proxy's rule).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import pytest
import yaml

from lorarl.local.ports import free_port
from lorarl.operator.config import DEFAULT_CERT_DIR
from tests.integration.test_operator_harness import quickstart
from tests.support.chart_release import (
    PORT_ENV,
    container_env,
    find,
    mount_secret_volumes,
    operator_container,
    wait_for,
)
from tests.support.controlplane import ControlPlane, control_plane, write_kubeconfig
from tests.support.kube_client import KubeClient
from tests.unit.test_helm_chart import CHART

NS = "lorarl-system"
JOBS_NS = "default"
Obj = dict[str, Any]


@dataclass
class Installed:
    cp: ControlPlane
    kube: KubeClient
    objs: list[Obj]
    revision: int


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """A control plane of its own (Helm must install the CRD itself), and `helm install`."""
    tmp = tmp_path_factory.mktemp("helm")
    with control_plane(tmp / "cp", scheduler=False) as cp:
        config = helm.Config(kubeconfig_path=str(cp.kubeconfig_path), namespace=NS)
        try:
            release = config.install(str(CHART), "lorarl", {}, create_namespace=True, timeout=120)
            manifest = release.manifest if hasattr(release, "manifest") else release["manifest"]
            objs = [d for d in yaml.safe_load_all(manifest) if d]
            kube = KubeClient(cp, JOBS_NS)
            yield Installed(cp, kube, objs, 1)
            kube.close()
        finally:
            config.close()


def test_helm_installs_the_crd_and_every_template(installed: Installed) -> None:
    cp = installed.cp
    crd = json.loads(cp.kubectl_ok("get", "crd", "lorarljobs.lorarl.dev", "-o", "json"))
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"
    kinds = {o["kind"] for o in installed.objs}
    assert {"Deployment", "ValidatingWebhookConfiguration", "ClusterRole", "Service"} <= kinds
    for obj in installed.objs:
        ns = obj["metadata"].get("namespace")
        args = ["get", obj["kind"].lower(), obj["metadata"]["name"], "-o", "name"]
        args += ["-n", ns] if ns else []
        assert cp.kubectl(*args).returncode == 0, f"{obj['kind']}/{obj['metadata']['name']}"


def test_helm_upgrade_and_status(installed: Installed) -> None:
    config = helm.Config(kubeconfig_path=str(installed.cp.kubeconfig_path), namespace=NS)
    try:
        values = {"webhook": {"timeoutSeconds": 15}}
        config.upgrade(str(CHART), "lorarl", values, timeout=120)
        history = config.history("lorarl")
        assert len(history) == 2, history
        webhooks = json.loads(
            installed.cp.kubectl_ok("get", "validatingwebhookconfigurations", "-o", "json")
        )["items"]
        timeouts = {w["timeoutSeconds"] for c in webhooks for w in c["webhooks"]}
        assert timeouts == {15}
    finally:
        config.close()


# -- the operator as its Deployment says -------------------------------------------------------


@pytest.fixture(scope="module")
def operator(installed: Installed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`python -m lorarl.operator` with the Deployment's command and env, its ServiceAccount's
    token, its webhook Secret, and the webhook on the Service's ClusterIP:port. Yields the log."""
    tmp = tmp_path_factory.mktemp("operator")
    cp, kube = installed.cp, installed.kube
    deployment = find(installed.objs, "Deployment", "lorarl-operator")
    container = operator_container(deployment)
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    token = kube.token(NS, account)
    kubeconfig = write_kubeconfig(tmp / "kubeconfig", cp.url, cp.ca_file, token=token, namespace=NS)
    mounts = mount_secret_volumes(
        lambda ns, name: kube.get("v1/secrets", ns, name), deployment, container, tmp / "volumes"
    )
    (webhook_cfg,) = [o for o in installed.objs if o["kind"] == "ValidatingWebhookConfiguration"]
    ref = webhook_cfg["webhooks"][0]["clientConfig"]["service"]
    service = kube.get("v1/services", ref["namespace"], ref["name"])
    assert service is not None
    cert_dir = mounts[DEFAULT_CERT_DIR]  # the webhook Secret's mount
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")},
        **container_env(container),
        "KUBECONFIG": str(kubeconfig),
        "LORARL_OPERATOR_NAMESPACE": NS,
        "LORARL_WEBHOOK_CERT_DIR": str(cert_dir),
        # The Service's address and port: what the API server dials for the webhook.
        "LORARL_WEBHOOK_ADDR": service["spec"]["clusterIP"],
        "LORARL_WEBHOOK_PORT": str(ref.get("port", 443)),
        "LORARL_METRICS_PORT": str(free_port()),
        "LORARL_HEALTH_PORT": str(free_port()),
        "LORARL_TIMER_SECONDS": "0.5",
        "HOME": str(tmp),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    assert set(PORT_ENV) <= set(container_env(container))
    argv = [*container["command"], *container.get("args", [])]
    assert argv == ["python", "-m", "lorarl.operator"]
    log = tmp / "operator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["setpriv", "--pdeathsig", "TERM", "--", *argv], env=env, stdout=out,
            stderr=subprocess.STDOUT, cwd=tmp,
        )  # fmt: skip
    health = f"http://127.0.0.1:{env['LORARL_HEALTH_PORT']}/healthz"

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"operator exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            return httpx.get(health, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 60, "operator /healthz")
        yield log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_the_webhook_is_called_through_the_charts_service(installed: Installed, operator: Path):
    bad = quickstart("unknown-reward", reward={"function": "no_such_reward"})

    def refused() -> str | None:
        done = installed.kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(bad))
        return done.stderr if done.returncode else None

    stderr = wait_for(refused, 30, "the webhook refusing a job")
    assert 'admission webhook "validate.lorarljobs.lorarl.dev" denied the request' in stderr
    assert "spec.reward.function" in stderr


def test_the_operator_reconciles_under_the_charts_rbac(installed: Installed, operator: Path):
    kube = installed.kube
    kube.create("lorarl.dev/v1alpha1/lorarljobs", quickstart("charted"), namespace=JOBS_NS)
    pods = {"charted-trainer-0", "charted-rollout-0", "charted-rollout-1"}

    def made() -> bool:
        names = {
            p["metadata"]["name"]
            for p in kube.list_objects("v1/pods", JOBS_NS, "lorarl.dev/job=charted")
        }
        return names == pods

    wait_for(made, 60, "the job's pods")
    for name in pods:
        kube.set_pod_phase(JOBS_NS, name, "Running")
    wait_for(
        lambda: (
            (kube.get("lorarl.dev/v1alpha1/lorarljobs", JOBS_NS, "charted") or {})
            .get("status", {})
            .get("phase")
            == "Running"
        ),
        30,
        "phase Running",
    )
    # The API server's audit log: every request of the operator's ServiceAccount, and none
    # refused by RBAC (403) or unauthenticated (401).
    account = "system:serviceaccount:lorarl-system:lorarl-operator"
    entries = [
        json.loads(line)
        for line in (installed.cp.workdir / "logs" / "audit.log").read_text().splitlines()
        if account in line
    ]
    done = [e for e in entries if e.get("stage") == "ResponseComplete"]
    assert len(done) >= 20, f"only {len(done)} operator requests audited"
    # RBAC's refusals are audited as decision "forbid" (a 403 from an admission plugin is not).
    denied = [
        (e["verb"], e["requestURI"], e["responseStatus"].get("message", ""))
        for e in done
        if (e.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid"
        or e.get("responseStatus", {}).get("code") == 401
    ]
    allowed = [
        e
        for e in done
        if (e.get("annotations") or {}).get("authorization.k8s.io/decision") == "allow"
    ]
    assert len(allowed) >= 20, "the audit log records no authorization decisions"
    assert not denied, (
        f"the chart's RBAC refused the operator: {denied}\n{operator.read_text()[-3000:]}"
    )
