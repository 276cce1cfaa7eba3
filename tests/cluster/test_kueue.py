"""`spec.scheduling.queueName` with real Kueue (its `pod` integration): a ClusterQueue with room
for one job admits the first job's pod group and holds the second's pods behind Kueue's
scheduling gate until the first job ends, then admits it. On a control plane of its own: Kueue's
webhooks are cluster-wide and fail closed."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from harness.cluster.controlplane import control_plane
from harness.cluster.kueue import kueue
from tests.integration.test_operator_harness import Cluster, cluster, quickstart, wait_for

NS = "team-a"
GATE = "kueue.x-k8s.io/admission"
ONE_CPU = {"requests": {"cpu": "1", "memory": "256Mi"}, "limits": {"memory": "256Mi"}}


def _job(name: str) -> dict[str, Any]:
    return quickstart(
        name,
        scheduling={"queueName": "team-q"},
        trainer={"resources": ONE_CPU},
        rollout={"replicas": 2, "resources": ONE_CPU},
    )


def _pods(c: Cluster, job: str) -> dict[str, dict[str, Any]]:
    return c.pods(job)


def _gated(pod: dict[str, Any]) -> bool:
    return any(g["name"] == GATE for g in pod["spec"].get("schedulingGates") or [])


def _requests(pods: dict[str, dict[str, Any]]) -> dict[str, int]:
    """What Kueue counts for the group: each container's requests (limits where a resource has
    no request, as the API server defaults them), summed; cpu in millicores, memory in bytes."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "": 1}
    total: dict[str, int] = {}
    for pod in pods.values():
        for container in pod["spec"]["containers"]:
            res = container.get("resources") or {}
            merged = {**res.get("limits", {}), **res.get("requests", {})}
            for name, value in merged.items():
                number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()
                amount = float(number) * units[unit]
                total[name] = total.get(name, 0) + round(amount * 1000 if name == "cpu" else amount)
    return total


def _quota(amounts: dict[str, int]) -> list[dict[str, str]]:
    return [
        {"name": name, "nominalQuota": f"{amount}m" if name == "cpu" else str(amount)}
        for name, amount in sorted(amounts.items())
    ]


def _queues(one_job: dict[str, int]) -> list[dict[str, Any]]:
    return [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
         "metadata": {"name": "default-flavor"}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
         "metadata": {"name": "cq"},
         "spec": {"namespaceSelector": {},
                  "resourceGroups": [{"coveredResources": sorted(one_job), "flavors": [
                      {"name": "default-flavor", "resources": _quota(one_job)}]}]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": "team-q", "namespace": NS}, "spec": {"clusterQueue": "cq"}},
    ]  # fmt: skip


def test_a_queue_with_room_for_one_job_runs_two_jobs_one_after_the_other(tmp_path: Path) -> None:
    with (
        control_plane(tmp_path / "cp", scheduler=False) as cp,
        kueue(cp, tmp_path / "kueue") as log,
        cluster(cp, tmp_path / "op", namespace=NS, webhook=False) as c,
    ):
        names = {f"first-{r}" for r in ("trainer-0", "rollout-0", "rollout-1")}
        c.create(_job("first"))
        c.wait_pods("first", names, timeout=30)
        first = _pods(c, "first")
        # Kueue's webhook gated every pod of the group: nothing schedules before admission.
        assert all(_gated(p) for p in first.values()), [p["spec"] for p in first.values()]
        one_job = _requests(first)  # the quota: room for exactly one job
        assert one_job["cpu"] >= 3000, one_job
        for obj in _queues(one_job):
            cp.kubectl_ok("apply", "-f", "-", input=json.dumps(obj))

        wait_for(
            lambda: not any(_gated(p) for p in _pods(c, "first").values()),
            60,
            f"the first job admitted (Kueue log: {log})",
        )
        c.create(_job("second"))
        c.wait_pods("second", {n.replace("first", "second") for n in names}, timeout=30)
        time.sleep(3.0)  # Kueue has had its chance to admit: the queue is full
        assert all(_gated(p) for p in _pods(c, "second").values())
        workloads = json.loads(cp.kubectl_ok("get", "workloads", "-n", NS, "-o", "json"))["items"]
        admitted = {
            w["metadata"]["name"]: any(
                x["type"] == "Admitted" and x["status"] == "True"
                for x in (w.get("status") or {}).get("conditions", [])
            )
            for w in workloads
        }
        assert sorted(admitted.values()) == [False, True], admitted

        # The first job ends: its trainer succeeds, the operator stops its engines (their
        # kubelet, played here, reports them ended by SIGTERM) and marks the group as not to be
        # retried; Kueue sees every pod ended, ends the Workload and frees its quota.
        c.run_all("first")
        c.kube.set_pod_phase(NS, "first-trainer-0", "Succeeded")
        c.wait_phase("first", "Succeeded", timeout=30)
        for engine in ("first-rollout-0", "first-rollout-1"):
            wait_for(
                lambda e=engine: (
                    (c.kube.get("v1/pods", NS, e) or {})
                    .get("metadata", {})
                    .get("deletionTimestamp")
                ),
                30,
                f"{engine} deleted by the operator",
            )
            c.kube.set_pod_phase(NS, engine, "Failed", exit_code=143, reason="Error")

        # The operator marks the pods one by one after it writes the final status, so the
        # last mark can land just after the engines are seen deleted: wait for every one (a pod
        # Kueue has already let go of is gone from the list).
        def all_marked() -> bool:
            marked = c.kube.list_objects("v1/pods", NS, "lorarl.dev/job=first")
            return all(
                p["metadata"].get("annotations", {}).get("kueue.x-k8s.io/retriable-in-group")
                == "false"
                for p in marked
            )

        wait_for(all_marked, 15, "every pod of the first job marked not retriable")
        wait_for(
            lambda: not any(_gated(p) for p in _pods(c, "second").values()),
            90,
            "the second job admitted once the first ended",
        )
        c.run_all("second")
        c.wait_phase("second", "Running", timeout=30)
