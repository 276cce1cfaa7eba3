"""Seams between the operator's Pod objects and the code they run, shown on the real control
plane under the process kubelet: the pod shape before each fix fails the way a cluster would
fail it, and the operator's current shape passes.

The pods are the operator's own (`lorarl.operator.builders`, from the plan of the quickstart job);
only the container command is swapped for a probe that runs the same library call the trainer or
sidecar makes at that point (writing progress to the output dir; forming the sync group).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.cluster.controlplane import control_plane
from harness.cluster.kube_client import KubeClient
from harness.kubelet import Kubelet
from lorarl.api.resource import LoRARLJob
from lorarl.operator import builders
from lorarl.plan import plan
from lorarl.plan.addressing import CLUSTER_PORTS

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
OPERATOR_NS = "lorarl-system"
Obj = dict[str, Any]
PLURALS = {"Pod": "v1/pods", "Service": "v1/services", "Secret": "v1/secrets",
           "ConfigMap": "v1/configmaps", "PersistentVolumeClaim": "v1/persistentvolumeclaims",
           "NetworkPolicy": "networking.k8s.io/v1/networkpolicies"}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KubeClient, Kubelet]]:
    with (
        control_plane(tmp_path_factory.mktemp("cp")) as cp,
        Kubelet(cp, max_grace=1.0) as kubelet,
    ):
        kube = KubeClient(cp)
        yield kube, kubelet
        kubelet.raise_errors()
        kube.close()


def job(namespace: str, **training: Any) -> LoRARLJob:
    doc = copy.deepcopy(QUICKSTART)
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["rollout"]["replicas"] = 1
    doc["spec"]["training"].update(training)
    doc["spec"]["training"] = {k: v for k, v in doc["spec"]["training"].items() if v is not None}
    return LoRARLJob.model_validate(doc)


def apply(kube: KubeClient, namespace: str, *objs: Obj) -> None:
    if kube.get("v1/namespaces", None, namespace) is None:
        kube.cp.create_namespace(namespace)
    for obj in objs:
        kube.create(PLURALS[obj["kind"]], obj)


def probe(pod: Obj, container: str, script: str) -> Obj:
    """The operator's pod with one container's command swapped for `script` (same image, env,
    mounts, security context)."""
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == container]
    c["command"] = ["python", "-c", script]
    return pod


def finished(kube: KubeClient, kubelet: Kubelet, ns: str, name: str, timeout: float = 120) -> Obj:
    def done() -> Obj | None:
        p = kube.get("v1/pods", ns, name)
        return p if p and (p.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None

    return kubelet.wait(done, timeout, f"pod {ns}/{name} finished")


def termination(p: Obj, container: str) -> Obj:
    (cs,) = [c for c in p["status"]["containerStatuses"] if c["name"] == container]
    return cs["state"]["terminated"]


# -- outputs on a read-only root ---------------------------------------------------------------

WRITE_PROGRESS = """
import os
from lorarl.api.reports.progress import Progress
from lorarl.api.reports.run_files import write_progress
from lorarl.trainer.settings import load_job, output_dirs
job = load_job(os.environ["LORARL_CONFIG"])
root, _, _ = output_dirs(job)
write_progress(root, Progress(job=job.name, phase="Running", total_steps=1))
print("wrote", root / "progress.json")
"""


def claims(j: LoRARLJob) -> list[Obj]:
    """The job's output claim, as an admin would have created it."""
    volume = j.spec.training.volume
    if volume is None:
        return []
    meta = {"name": volume.claim_name, "namespace": j.namespace}
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}
    return [{"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}]


def trainer_objects(j: LoRARLJob) -> list[Obj]:
    p = plan(j)
    trainer = probe(builders.pod(p, j, "trainer", 0), "trainer", WRITE_PROGRESS)
    secret = builders.engine_key_secret(p, "key", "sync-key")
    return [*claims(j), builders.config_map(p), secret, trainer]


def test_output_dir_before_and_after_the_fix(cluster: tuple[KubeClient, Kubelet]) -> None:
    """Before: `outputDir` defaulted to /workspace/output with no volume, on the read-only root.
    After: cluster jobs keep outputs on `training.volume` (a claim), under its mountPath."""
    kube, kubelet = cluster
    before = job("seam-output-before", outputDir=None, volume=None)
    assert before.spec.training.output_dir == "/workspace/output"
    after = job("seam-output-after")
    volume = after.spec.training.volume
    assert volume is not None and after.spec.training.output_dir.startswith(volume.mount_path)
    # Both shapes side by side (own namespaces): a pod start is most of this test's time.
    apply(kube, "seam-output-before", *trainer_objects(before))
    apply(kube, "seam-output-after", *trainer_objects(after))
    p = finished(kube, kubelet, "seam-output-before", "quickstart-trainer-0")
    term = termination(p, "trainer")
    assert p["status"]["phase"] == "Failed" and term["exitCode"] == 1
    # FallbackToLogsOnError: the job's Failed condition can say why, not just "exit code 1".
    assert "Read-only file system: '/workspace'" in term["message"]

    p = finished(kube, kubelet, "seam-output-after", "quickstart-trainer-0")
    assert p["status"]["phase"] == "Succeeded", kubelet.logs(
        "seam-output-after", "quickstart-trainer-0", "trainer"
    )
    written = after.spec.training.output_dir[len(volume.mount_path) :].strip("/")
    out = kubelet.claim_dir("seam-output-after", volume.claim_name) / written / "progress.json"
    assert out.is_file() and out.stat().st_uid == builders.RUN_AS


# -- the sync group under the job's NetworkPolicy ----------------------------------------------

SEND = """
import os, torch
from lorarl.sync.buckets import SyncHeader
from lorarl.sync.transport import SyncSender
e = os.environ
sender = SyncSender(e["LORARL_SYNC_ADDR"], int(e["LORARL_SYNC_PORT"]), e["LORARL_SYNC_BACKEND"],
                    timeout=20)
members = sender.wait_registered(int(e["LORARL_SYNC_WORLD_SIZE"]) - 1, timeout=60)
header = SyncHeader(version=1, mode="merged", scaling=2.0, rank=8, alpha=16.0,
                    target_modules=("q_proj",))
result = sender.send({"w": torch.arange(8.0)}, header, members)
assert result.ok, result
sender.close()
print("sent version 1 to", len(result.acks), "receivers")
"""

RECEIVE = """
import os, time
from lorarl.sync.transport import SyncReceiver
e = os.environ
receiver = SyncReceiver(
    e["LORARL_SYNC_ADDR"], int(e["LORARL_SYNC_PORT"]), int(e["LORARL_ROLLOUT_INDEX"]),
    backend=e["LORARL_SYNC_BACKEND"], timeout=20)
got = receiver.recv(timeout=60)
receiver.ack(got.header.version)
print("received", sorted(got.tensors), flush=True)
time.sleep(3600)  # a rollout pod restarts exited containers (restartPolicy Always): stay up
"""

IDLE_ENGINE = "import time; time.sleep(3600)"


def policy_before_the_fix(p: Any, operator_namespace: str) -> Obj:
    """The per-job policy as the operator wrote it before: job pods admitted only on the named
    ports (rendezvous, sync, engine, sidecar, reward); gloo's own connections use others."""
    policy = builders.network_policy(p, operator_namespace)
    same_job = policy["spec"]["ingress"][0]
    named = ("master", "sync", "engine", "sidecar", "reward")
    same_job["ports"] = [{"port": CLUSTER_PORTS[n], "protocol": "TCP"} for n in named]
    return policy


def sync_objects(j: LoRARLJob, policy: Obj) -> list[Obj]:
    p = plan(j)
    trainer = probe(builders.pod(p, j, "trainer", 0), "trainer", SEND)
    rollout = probe(builders.pod(p, j, "rollout", 0), "sidecar", RECEIVE)
    rollout = probe(rollout, "engine", IDLE_ENGINE)
    return [*claims(j), builders.service(p), builders.config_map(p),
            builders.engine_key_secret(p, "key", "sync-key"), policy, trainer, rollout]  # fmt: skip


def test_sync_group_under_the_job_network_policy(cluster: tuple[KubeClient, Kubelet]) -> None:
    """The sync group's TCPStore is on the named sync port, but gloo then connects each pair of
    ranks on ephemeral ports: a policy that admits only the named ports drops those, and the
    first sync hangs (gloo retries its connects; the trainer would wait out its timeout). Both
    shapes run side by side; the fixed one finishes, the old one is still stuck well after."""
    kube, kubelet = cluster
    shapes = {"seam-sync-before": policy_before_the_fix, "seam-sync-after": builders.network_policy}
    for ns, make_policy in shapes.items():
        j = job(ns)
        apply(kube, ns, *sync_objects(j, make_policy(plan(j), OPERATOR_NS)))
    trainer = finished(kube, kubelet, "seam-sync-after", "quickstart-trainer-0", timeout=180)
    log = kubelet.logs("seam-sync-after", "quickstart-trainer-0", "trainer")
    assert trainer["status"]["phase"] == "Succeeded", log
    assert "sent version 1 to 1 receivers" in log
    assert "received ['w']" in kubelet.logs("seam-sync-after", "quickstart-rollout-0", "sidecar")
    assert kubelet.dropped("seam-sync-after", "quickstart-trainer-0") == 0

    # The old shape had as long as the new one took, and 10 s more: its trainer still waits
    # while the kubelet's counters show the policy dropping gloo's connections.
    time.sleep(10)
    stuck = kube.get("v1/pods", "seam-sync-before", "quickstart-trainer-0")
    assert stuck["status"]["phase"] == "Running"
    assert "received" not in kubelet.logs("seam-sync-before", "quickstart-rollout-0", "sidecar")
    refused = sum(
        kubelet.dropped("seam-sync-before", pod)
        for pod in ("quickstart-trainer-0", "quickstart-rollout-0")
    )
    assert refused > 0, "the old policy should have dropped gloo's connections"
    for ns in shapes:
        for pod in ("quickstart-trainer-0", "quickstart-rollout-0"):
            kube.delete("v1/pods", ns, pod)
