"""`helm install` as the README says, with real Helm (the Helm v4 SDK) into a real API server:
the chart's CRD and every template are accepted, `helm upgrade` works, and the operator, running
as the Deployment's pod under the process kubelet with its ServiceAccount's token projected,
reconciles jobs under the chart's RBAC (checked by the API server's own audit log: no request
denied) while the API server calls its webhook through the chart's Service over TLS.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import helm_python as helm
import pytest
import yaml

from harness.cluster.cluster import NS, RELEASE, Cluster, cluster
from harness.cluster.controlplane import wait_until
from tests.integration.test_operator_harness import quickstart
from tests.unit.deploy.test_helm_chart import CHART

JOBS_NS = "default"
# The job's pods stay Pending (no node has this label): what is checked is the operator's work
# through the API server, not training.
NOWHERE = {"lorarl.dev/test-node": "nowhere"}


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane of its own (Helm must install the CRD itself), `helm install`, and the
    operator's and status API's pods Ready."""
    with cluster(tmp_path_factory.mktemp("helm")) as running:
        yield running


def test_helm_installs_the_crd_and_every_template(c: Cluster) -> None:
    crd = json.loads(c.cp.kubectl_ok("get", "crd", "lorarljobs.lorarl.dev", "-o", "json"))
    assert {x["type"]: x["status"] for x in crd["status"]["conditions"]}["Established"] == "True"
    kinds = {o["kind"] for o in c.objs}
    assert {"Deployment", "ValidatingWebhookConfiguration", "ClusterRole", "Service"} <= kinds
    for obj in c.objs:
        ns = obj["metadata"].get("namespace")
        args = ["get", obj["kind"].lower(), obj["metadata"]["name"], "-o", "name"]
        args += ["-n", ns] if ns else []
        assert c.cp.kubectl(*args).returncode == 0, f"{obj['kind']}/{obj['metadata']['name']}"
    # The Deployments rolled out: the controller-manager made their pods, the kubelet ran them.
    for name in ("lorarl-operator", "lorarl-status-api"):
        c.cp.kubectl_ok("-n", NS, "rollout", "status", f"deploy/{name}", "--timeout=60s")


def test_helm_upgrade_and_status(c: Cluster) -> None:
    config = helm.Config(kubeconfig_path=str(c.cp.kubeconfig_path), namespace=NS)
    try:
        values = {"webhook": {"timeoutSeconds": 15}}
        config.upgrade(str(CHART), RELEASE, values, timeout=120)
        history = config.history(RELEASE)
        assert len(history) == 2, history
        webhooks = json.loads(
            c.cp.kubectl_ok("get", "validatingwebhookconfigurations", "-o", "json")
        )["items"]
        timeouts = {w["timeoutSeconds"] for x in webhooks for w in x["webhooks"]}
        assert timeouts == {15}
    finally:
        config.close()


def test_the_webhook_is_called_through_the_charts_service(c: Cluster) -> None:
    bad = quickstart("unknown-reward", reward={"function": "no_such_reward"})
    refusals: list[str] = []

    def refused() -> bool:
        done = c.cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(bad))
        refusals.append(done.stderr)
        return done.returncode != 0

    wait_until(refused, 30, "the webhook refusing a job")
    stderr = refusals[-1]
    assert 'admission webhook "validate.lorarljobs.lorarl.dev" denied the request' in stderr
    assert "spec.reward.function" in stderr


def test_the_operator_reconciles_under_the_charts_rbac(c: Cluster) -> None:
    kube = c.kube
    job = quickstart("charted", trainer__nodeSelector=NOWHERE, rollout__nodeSelector=NOWHERE)
    kube.create("lorarl.dev/v1alpha1/lorarljobs", job, namespace=JOBS_NS)
    pods = {"charted-trainer-0", "charted-rollout-0", "charted-rollout-1"}

    def made() -> bool:
        names = {
            p["metadata"]["name"]
            for p in kube.list_objects("v1/pods", JOBS_NS, "lorarl.dev/job=charted")
        }
        return names == pods

    wait_until(made, 60, "the job's pods")
    wait_until(
        lambda: (
            (kube.get("lorarl.dev/v1alpha1/lorarljobs", JOBS_NS, "charted") or {})
            .get("status", {})
            .get("phase")
            == "Pending"
        ),
        30,
        "phase Pending (its pods unschedulable)",
    )
    # The operator's pod replaced (as after a node loss): the new one resumes the job it finds
    # (the resume path creates nothing twice and reads nothing its RBAC does not allow) and
    # reconciles it, here re-creating a pod that was deleted while no operator ran.
    (old,) = c.component_pods("operator")
    c.cp.kubectl_ok("-n", NS, "delete", "pod", old["metadata"]["name"], "--wait=false")
    c.kube.delete("v1/pods", JOBS_NS, "charted-rollout-1")
    wait_until(
        lambda: any(p["metadata"]["uid"] != old["metadata"]["uid"]
                    for p in c.component_pods("operator")),
        60, "a new operator pod",
    )  # fmt: skip
    c.wait_ready("operator")
    wait_until(made, 60, "the deleted pod re-created by the new operator")
    # The API server's audit log: every request of the operator's ServiceAccount, and none
    # refused by RBAC (403) or unauthenticated (401), before the restart or after it.
    account = "system:serviceaccount:lorarl-system:lorarl-operator"
    entries = [
        json.loads(line)
        for line in (c.cp.workdir / "logs" / "audit.log").read_text().splitlines()
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
        f"the chart's RBAC refused the operator: {denied}\n{c.component_log('operator')[-3000:]}"
    )
