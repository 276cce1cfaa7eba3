"""`helm install` gives a working operator: the chart's default render is applied to the API
server emulator with the real kubectl, and the operator is started exactly as its Deployment says,
with only what a pod gets from the kubelet swapped for local stand-ins (listed in
tests/support/chart_release.py, shared with the cluster end-to-end tests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.chart_release import (
    OPERATOR_TOKEN,
    PORT_ENV,
    Release,
    allows,
    bound_rules,
    container_env,
    find,
    install,
    kubectl_ok,
    operator_container,
    rbac_attributes,
    wait_for,
)
from tests.support.kube_emulator import KubeApi, kube_api
from tests.unit.test_helm_chart import NS, render_chart

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART_PODS = {"quickstart-trainer-0", "quickstart-rollout-0", "quickstart-rollout-1"}
Obj = dict[str, Any]


def test_rbac_evaluation_catches_a_missing_verb() -> None:
    rules = [(None, {"apiGroups": ["lorarl.dev"], "resources": ["lorarljobs"], "verbs": ["get"]})]
    assert allows(rules, "get", "lorarl.dev", "lorarljobs", "default")
    assert not allows(rules, "delete", "lorarl.dev", "lorarljobs", "default")
    assert not allows(rules, "get", "lorarl.dev", "lorarljobs/status", "default")
    scoped = [("ns-a", rules[0][1])]
    assert not allows(scoped, "get", "lorarl.dev", "lorarljobs", "ns-b")
    assert not allows(scoped, "get", "lorarl.dev", "lorarljobs", None)  # cluster-wide list


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    tmp = tmp_path_factory.mktemp("chart-install")
    with kube_api() as kube, install(kube, render_chart(namespace=NS), tmp, NS) as rel:
        yield rel


# -- the tests (in order: the last one stops the operator) -------------------------------------


def test_every_rendered_object_was_applied(release: Release) -> None:
    # Only the `helm test` hook objects stay out: the emulator serves every default kind.
    assert release.skipped == ["ServiceAccount/lorarl-test", "Pod/lorarl-test"]
    stored = kubectl_ok(release.kube, "get", "-f", str(release.manifest), "-o", "name").split()
    expected = []
    for obj in release.objs:
        group = obj["apiVersion"].rpartition("/")[0]
        name = f"{obj['kind'].lower()}{'.' + group if group else ''}/{obj['metadata']['name']}"
        if f"{obj['kind']}/{obj['metadata']['name']}" not in release.skipped:
            expected.append(name)
    assert sorted(stored) == sorted(expected)
    assert "validatingwebhookconfiguration.admissionregistration.k8s.io/" in " ".join(stored)
    assert release.argv == ["python", "-m", "lorarl.operator"]
    deployment = find(release.objs, "Deployment", "lorarl-operator")
    for name, value in container_env(operator_container(deployment)).items():
        assert release.env[name] == value or name in PORT_ENV, name


def test_quickstart_gets_its_pods_service_and_config(release: Release) -> None:
    kube = release.kube
    kubectl_ok(kube, "apply", "-f", str(ROOT / "examples" / "quickstart.yaml"))

    def pods() -> set[str]:
        return {p["metadata"]["name"] for p in kube.emulator.list_objects("v1/pods", "default")}

    wait_for(lambda: pods() >= QUICKSTART_PODS, 60, f"pods {sorted(QUICKSTART_PODS)}")
    service = wait_for(lambda: kube.emulator.get("v1/services", "default", "quickstart"), 10)
    assert service["spec"]["clusterIP"] == "None"
    config = wait_for(lambda: kube.emulator.get("v1/configmaps", "default", "quickstart-config"))
    assert "rank: 8" in config["data"]["job.yaml"]
    shown = kubectl_ok(kube, "get", "lrj", "quickstart", "-o", "jsonpath={.status.phase}")
    assert shown in ("Pending", "Running")


def test_chart_webhook_refuses_a_bad_manifest(release: Release) -> None:
    refused = release.kube.kubectl("apply", "-f", str(ROOT / "examples/bad/rank-zero.yaml"))
    assert refused.returncode == 1
    assert 'admission webhook "validate.lorarljobs.lorarl.dev" denied the request' in refused.stderr
    assert "spec.lora.rank: must be greater than 0 (got 0)" in refused.stderr


def test_finished_job_is_deleted_after_its_ttl(release: Release) -> None:
    kube = release.kube
    job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    job["metadata"]["name"] = "brief"
    job["spec"]["runPolicy"] = {"ttlSecondsAfterFinished": 0}
    done = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(job))
    assert done.returncode == 0, done.stderr
    lrj = "lorarl.dev/v1alpha1/lorarljobs"
    wait_for(lambda: kube.emulator.get("v1/pods", "default", "brief-trainer-0"), 30, "trainer")
    kube.set_pod_phase("default", "brief-trainer-0", "Succeeded")
    wait_for(lambda: kube.emulator.get(lrj, "default", "brief") is None, 30, "TTL deletion")


def operator_requests(kube: KubeApi) -> Iterator[tuple[Any, dict[str, str]]]:
    """Every HTTP request but kubectl's, with lower-cased headers: the tests reach the emulator
    in-process, so the rest came from the operator (kopf's client and its own), whatever
    credentials they carried."""
    for request in list(kube.emulator):
        headers = {k.lower(): v for k, v in request.headers.items()}
        if not headers.get("user-agent", "").startswith("kubectl"):
            yield request, headers


def test_operator_stops_cleanly_and_the_chart_rbac_allowed_every_request(
    release: Release,
) -> None:
    """Run last: a real API server would have refused any request the chart's RBAC does not
    grant the operator's service account (authenticated here by its own token)."""
    assert release.stop() == 0, release.logs()
    deployment = find(release.objs, "Deployment", "lorarl-operator")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    rules = bound_rules(release.objs, account, NS)
    assert rules, f"nothing is bound to ServiceAccount {account}"
    seen, anonymous, denied = set(), set(), set()
    for request, headers in operator_requests(release.kube):
        attrs = rbac_attributes(request)
        if attrs is None:
            continue
        seen.add(attrs)
        if headers.get("authorization") != f"Bearer {OPERATOR_TOKEN}":
            anonymous.add(attrs)  # a real API server answers 401
        elif not allows(rules, *attrs):
            denied.add(attrs)  # ... or 403
    assert ("create", "", "pods", "default") in seen
    assert ("patch", "lorarl.dev", "lorarljobs/status", "default") in seen
    assert ("delete", "lorarl.dev", "lorarljobs", "default") in seen  # the TTL deletion
    assert anonymous == set(), f"sent without the service account token: {sorted(anonymous)}"
    assert denied == set(), f"forbidden by the chart's RBAC: {sorted(denied, key=str)}"
