"""The operator end to end over real HTTP: kubectl apply/get/scale/delete, the children it
creates, progress into status, what the status API reads back, Kueue and gang scheduling."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest

from lorarl.server.kube_api import KubeApi as StatusKubeApi
from lorarl.server.stores.kube import KubeStore
from tests.integration.test_operator_harness import (
    QUICKSTART,
    ROOT,
    Cluster,
    install_podgroup_crd,
    quickstart,
    shared,
    wait_for,
)

__all__ = ["shared"]
QUICKSTART_PODS = {"quickstart-trainer-0", "quickstart-rollout-0", "quickstart-rollout-1"}


def _valid(obj: dict) -> None:
    kubernetes_validate.validate(obj, "1.30", strict=True)


def test_kubectl_apply_get_scale_delete(shared: Cluster) -> None:
    kube = shared.kube
    applied = kube.kubectl("apply", "-f", str(ROOT / "examples" / "quickstart.yaml"))
    assert applied.returncode == 0, applied.stderr
    shared.wait_pods("quickstart", QUICKSTART_PODS)
    shared.run_all("quickstart")
    shared.wait_phase("quickstart", "Running")

    got = kube.kubectl("get", "lrj")
    assert got.returncode == 0, got.stderr
    header, *rows = got.stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "STEPS", "REWARD", "EVAL", "AGE"]
    row = next(r.split() for r in rows if r.startswith("quickstart "))
    assert row[:2] == ["quickstart", "Running"]
    wide = kube.kubectl("get", "lrj", "quickstart", "-o", "wide")
    assert wide.stdout.splitlines()[0].split()[-4:] == ["SYNC", "RUNNING", "REASON", "AGE"]
    assert wide.stdout.splitlines()[1].split()[-2] == "True"  # Running condition, by type

    # Children: named deterministically, owned by the job, valid Kubernetes objects.
    job = shared.job("quickstart")
    assert job is not None
    uid = job["metadata"]["uid"]
    children = {
        "Service": kube.get("v1/services", shared.namespace, "quickstart"),
        "ConfigMap": kube.get("v1/configmaps", shared.namespace, "quickstart-config"),
        "Secret": kube.get("v1/secrets", shared.namespace, "quickstart-engine-key"),
        "NetworkPolicy": kube.get(
            "networking.k8s.io/v1/networkpolicies", shared.namespace, "quickstart"
        ),
        **shared.pods("quickstart"),
    }
    for kind, obj in children.items():
        assert obj is not None, kind
        owners = obj["metadata"]["ownerReferences"]
        assert [(o["kind"], o["uid"], o["controller"]) for o in owners] == [
            ("LoRARLJob", uid, True)
        ], kind
        _valid({k: v for k, v in obj.items() if k != "status"})
    svc = children["Service"]["spec"]
    assert (svc["clusterIP"], svc["publishNotReadyAddresses"]) == ("None", True)
    config = children["ConfigMap"]["data"]["job.yaml"]
    steps = QUICKSTART["spec"]["training"]["totalSteps"]
    assert "replicas: 2" in config and f"totalSteps: {steps}" in config
    trainer = children["quickstart-trainer-0"]["spec"]
    assert (trainer["hostname"], trainer["subdomain"]) == ("quickstart-trainer-0", "quickstart")
    env = {e["name"]: e for e in trainer["containers"][0]["env"]}
    assert env["MASTER_ADDR"]["value"] == "quickstart-trainer-0.quickstart"
    assert env["LORARL_SYNC_WORLD_SIZE"]["value"] == "3"
    assert env["LORARL_ENGINE_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "quickstart-engine-key", "key": "api-key"}
    }
    rollout = children["quickstart-rollout-1"]["spec"]
    assert [c["name"] for c in rollout["containers"]] == ["engine", "sidecar"]
    shm = next(v for v in rollout["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory"}
    assert all(
        {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"] for c in rollout["containers"]
    )

    scaled = kube.kubectl("scale", "lrj/quickstart", "--replicas=3")
    assert scaled.returncode == 0, scaled.stderr
    shared.wait_pods("quickstart", QUICKSTART_PODS | {"quickstart-rollout-2"})
    wait_for(lambda: shared.status("quickstart").get("rolloutReplicas") == 3)
    new = shared.pods("quickstart")["quickstart-rollout-2"]
    sidecar_env = {e["name"]: e.get("value") for e in new["spec"]["containers"][1]["env"]}
    assert sidecar_env["LORARL_ROLLOUT_INDEX"] == "2"  # joins by registering, no world size
    wait_for(
        lambda: (
            "replicas: 3"
            in kube.get("v1/configmaps", shared.namespace, "quickstart-config")["data"]["job.yaml"]
        )
    )
    scale = json.loads(
        kube.kubectl(
            "get",
            "--raw",
            f"/apis/lorarl.dev/v1alpha1/namespaces/{shared.namespace}/lorarljobs/quickstart/scale",
        ).stdout
    )
    assert scale["status"] == {
        "replicas": 3,
        "selector": "lorarl.dev/job=quickstart,lorarl.dev/role=rollout",
    }
    shared.wait_event(
        "quickstart",
        "Scaled",
        "rollout replicas 2 -> 3; the trainer picks up the change at its next step",
    )

    children_before = {(k, o["metadata"]["name"]) for k, o in children.items()}
    deleted = kube.kubectl("delete", "lrj", "quickstart", "--timeout=20s")
    assert deleted.returncode == 0, deleted.stderr
    assert shared.job("quickstart") is None
    # The real garbage collector (kube-controller-manager) removes every child by its owner
    # reference, the rollout pod added by the scale included.
    for kind, name in children_before | {("Pod", "quickstart-rollout-2")}:
        resource = {
            "Service": "v1/services",
            "ConfigMap": "v1/configmaps",
            "Secret": "v1/secrets",
            "NetworkPolicy": "networking.k8s.io/v1/networkpolicies",
        }.get(kind, "v1/pods")
        kube.wait_gone(resource, shared.namespace, name, timeout=60)
    assert shared.pods("quickstart") == {}


def test_progress_lands_in_status_and_the_status_api_reads_it(shared: Cluster) -> None:
    shared.create(quickstart("progress"))
    shared.wait_pods("progress", {"progress-trainer-0", "progress-rollout-0", "progress-rollout-1"})
    shared.run_all("progress")
    shared.trainer.step(3)
    # the step comes from a progress poll and the phase from pod events, written by different
    # triggers: wait for both before reading them back
    status = wait_for(
        lambda: (
            (s := shared.status("progress")).get("step") == 3 and s.get("phase") == "Running" and s
        ),
        10,
        "step 3 and phase Running in status",
    )
    assert status["totalSteps"] == 20  # what the trainer reports wins over the spec
    assert status["metrics"]["rewardMean"] == pytest.approx(0.3)  # make_record: 0.1 * step
    assert status["metrics"]["kl"] == pytest.approx(0.009)  # 0.001 * step**2
    assert status["lastSync"] == {
        "version": 3,
        "seconds": pytest.approx(0.23),
        "bytes": 3000,
        "mode": "merged",
    }
    assert "/progress" in shared.trainer.requests

    got = shared.kube.kubectl("get", "lrj", "progress")
    row = got.stdout.splitlines()[1].split()
    assert row[:4] == ["progress", "Running", "3/20", "0.300"]  # step/total, 3-digit reward
    wide = shared.kube.kubectl("get", "lrj", "progress", "-o", "wide").stdout.splitlines()
    at = wide[0].index("SYNC")  # by position: an empty column (no eval yet) prints nothing
    assert float(wide[1][at:].split()[0]) == pytest.approx(0.23), wide

    url, token, ca = shared.kube.reader_token(shared.namespace)
    store = KubeStore(StatusKubeApi(url, token=token, verify=ca), progress_url=shared.trainer.url)
    detail = store.get_job(shared.namespace, "progress")
    assert detail.detail is None  # the operator's status matches the API models exactly
    assert (detail.status.phase, detail.status.step) == ("Running", 3)
    assert {c.type for c in detail.conditions} >= {"Created", "Running", "TrainerReady"}
    summary = next(j for j in store.list_jobs() if j.name == "progress")
    assert summary.phase == "Running"


def test_kueue_labels_and_scheduler_plugins_pod_group(shared: Cluster) -> None:
    """(The PodGroup CRD of scheduler-plugins is installed by the `shared` fixture.)"""
    shared.create(
        quickstart("queued", scheduling={"queueName": "team-a", "gang": "scheduler-plugins"})
    )
    shared.wait_pods("queued", {"queued-trainer-0", "queued-rollout-0", "queued-rollout-1"})
    for pod in shared.pods("queued").values():
        labels, notes = pod["metadata"]["labels"], pod["metadata"].get("annotations", {})
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
        assert labels["kueue.x-k8s.io/pod-group-name"] == "queued"
        assert labels["scheduling.x-k8s.io/pod-group"] == "queued"
        assert notes["kueue.x-k8s.io/pod-group-total-count"] == "3"
    group = shared.kube.get("scheduling.x-k8s.io/v1alpha1/podgroups", shared.namespace, "queued")
    assert group is not None and group["spec"] == {"minMember": 3}


def test_volcano_pod_group(shared: Cluster, tmp_path: Path) -> None:
    install_podgroup_crd(shared.kube.cp, "scheduling.volcano.sh", "v1beta1", tmp_path)
    shared.create(quickstart("gang", scheduling={"gang": "volcano"}))
    shared.wait_pods("gang", {"gang-trainer-0", "gang-rollout-0", "gang-rollout-1"})
    group = shared.kube.get("scheduling.volcano.sh/v1beta1/podgroups", shared.namespace, "gang")
    assert group is not None and group["spec"]["minMember"] == 3
    pod = shared.pods("gang")["gang-trainer-0"]
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "gang"


def test_metrics_count_jobs_by_phase(shared: Cluster) -> None:
    shared.create(quickstart("counted"))
    shared.wait_phase("counted", "Pending")
    text = shared.operator.metrics()
    line = next(x for x in text.splitlines() if x.startswith('lorarl_jobs{phase="Pending"}'))
    assert float(line.split()[-1]) >= 1
    assert 'lorarl_reconcile_seconds_count{trigger="create"}' in text
