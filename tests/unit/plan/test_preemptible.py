"""spec.rollout.preemptible: spot tolerations and the label on rollout pods only, and a preempted
rollout pod recreated alone, counted apart from failures and never against backoffLimit."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from lorarl.api.reports.status import LoRARLJobStatus
from lorarl.api.validation import ManifestError, parse_job
from lorarl.operator import builders
from lorarl.operator.decide import Observed, decide
from lorarl.operator.reconciler import JobState
from lorarl.operator.status import PodView, pod_view
from lorarl.plan import plan
from lorarl.plan.preemptible import PREEMPTIBLE_LABEL, SPOT_TOLERATIONS
from tests.unit.operator.test_operator_decide import ALL_RUNNING, T0, job, observe, pod

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
SPOT = [t.wire() for t in SPOT_TOLERATIONS]


def _pods(rollout: dict[str, Any], reward: bool = True) -> dict[str, dict[str, Any]]:
    doc = copy.deepcopy(QUICKSTART)
    doc["spec"]["rollout"] = {**doc["spec"]["rollout"], **rollout}
    if reward:
        doc["spec"]["reward"]["service"] = {"replicas": 1}
    job = parse_job(doc)
    p = plan(job)
    return {
        f"{role.role}-{r.index}": builders.pod(p, job, role.role, r.index)
        for role in p.roles
        for r in role.replicas
    }


def test_spot_tolerations_and_label_only_on_rollout_pods_with_preemptible() -> None:
    pods = _pods({"preemptible": True})
    assert {"trainer-0", "rollout-0", "rollout-1", "reward-0"} <= set(pods)
    for name, p in pods.items():
        labels, tolerations = p["metadata"]["labels"], p["spec"].get("tolerations", [])
        if name.startswith("rollout"):
            assert tolerations == SPOT
            assert labels[PREEMPTIBLE_LABEL] == "true"
        else:  # trainer and reward pods never land on spot capacity
            assert tolerations == [] and PREEMPTIBLE_LABEL not in labels
    keys = {t["key"]: (t["value"], t["effect"]) for t in SPOT}
    assert keys == {
        "cloud.google.com/gke-spot": ("true", "NoSchedule"),
        "cloud.google.com/gke-preemptible": ("true", "NoSchedule"),
        "kubernetes.azure.com/scalesetpriority": ("spot", "NoSchedule"),
    }
    kubernetes_validate.validate(pods["rollout-0"], "1.30", strict=True)
    off = _pods({})
    assert "tolerations" not in off["rollout-0"]["spec"]
    assert PREEMPTIBLE_LABEL not in off["rollout-0"]["metadata"]["labels"]


def test_spot_tolerations_merge_with_the_users_without_duplicates() -> None:
    mine = [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
        # the same toleration as lorarl's GKE one, the operator left to its default (Equal)
        {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"},
    ]
    selector = {"cloud.google.com/gke-spot": "true"}
    pods = _pods({"preemptible": True, "tolerations": mine, "nodeSelector": selector})
    spec = pods["rollout-1"]["spec"]
    assert spec["tolerations"] == mine + SPOT[1:]  # the user's first, each taint once
    assert spec["nodeSelector"] == selector  # the user's selector picks the spot pool
    assert _pods({"tolerations": mine}, reward=False)["rollout-0"]["spec"]["tolerations"] == mine
    # a toleration that already covers a spot taint (Exists on its key, any effect) counts too
    exists = [{"key": "kubernetes.azure.com/scalesetpriority", "operator": "Exists"}]
    spec = _pods({"preemptible": True, "tolerations": exists}, reward=False)["rollout-0"]["spec"]
    assert spec["tolerations"] == exists + SPOT[:2]
    other_effect = [{**SPOT[0], "effect": "NoExecute"}]  # tolerates a different taint
    spec = _pods({"preemptible": True, "tolerations": other_effect})["rollout-0"]["spec"]
    assert spec["tolerations"] == other_effect + SPOT
    everything = [{"operator": "Exists"}]  # tolerates every taint: nothing to add
    spec = _pods({"preemptible": True, "tolerations": everything})["rollout-0"]["spec"]
    assert spec["tolerations"] == everything


def test_preemptible_must_be_a_boolean() -> None:
    doc = copy.deepcopy(QUICKSTART)
    doc["spec"]["rollout"]["preemptible"] = "sometimes"
    with pytest.raises(ManifestError, match=r"rollout\.preemptible"):
        parse_job(doc)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"reason": "Terminated", "pod_reason": "Terminated"}, "Terminated"),
        ({"reason": "Error", "exit_code": 143, "pod_reason": "Terminated"}, "Terminated"),
        ({"reason": "Evicted", "pod_reason": "Evicted"}, "Evicted"),
        ({"reason": "Error", "disruption": "TerminationByKubelet"}, "TerminationByKubelet"),
        ({"reason": "NodeShutdown", "pod_reason": "NodeShutdown"}, "NodeShutdown"),
    ],
)
def test_a_preempted_rollout_pod_is_recreated_with_a_normal_event_and_counted(
    kw: dict[str, Any], why: str
) -> None:
    running = observe(ALL_RUNNING).status
    preempted = pod("rollout", 1, "Failed", **kw)
    # backoffLimit 0: a trainer failure would fail the job; a preemption must not
    d = observe([pod("trainer", 0), pod("rollout", 0), preempted], status=running, backoffLimit=0)
    assert d.delete == ["quickstart-rollout-1"] and d.create == [("rollout", 1)]
    assert (d.status.rollout_preemptions, d.status.rollout_restarts) == (1, 0)
    assert (d.status.restarts, d.restarted, d.status.phase) == (0, False, "Starting")
    events = [(e.type, e.reason, e.message) for e in d.events if e.reason.startswith("Rollout")]
    assert events == [
        (
            "Normal",
            "RolloutPreempted",
            f"rollout pod quickstart-rollout-1 was preempted ({why}); recreating it alone, "
            "the trainer keeps going",
        )
    ]
    again = observe([pod("trainer", 0), pod("rollout", 0)], status=d.status, backoffLimit=0)
    assert again.status.rollout_preemptions == 1  # the pod is gone: nothing counted twice


def test_a_failed_rollout_pod_stays_a_warning_and_counts_as_a_restart() -> None:
    running = observe(ALL_RUNNING).status
    failed = pod("rollout", 0, "Failed", reason="OOMKilled", exit_code=137)
    d = observe([pod("trainer", 0), failed, pod("rollout", 1)], status=running, backoffLimit=0)
    assert (d.status.rollout_preemptions, d.status.rollout_restarts, d.status.restarts) == (0, 1, 0)
    assert [(e.type, e.reason) for e in d.events if e.reason.startswith("Rollout")] == [
        ("Warning", "RolloutRestart")
    ]


def _decide_lost(lost: list[PodView], status: LoRARLJobStatus, replicas: int = 2):
    return decide(
        Observed(
            job=job(backoffLimit=0),
            generation=3,
            status=status,
            replicas={"trainer": 1, "rollout": replicas},
            pods=[p for p in ALL_RUNNING if p.name not in {x.name for x in lost}],
            now=T0,
            lost=lost,
        )
    )


def test_a_vanished_rollout_pod_is_recreated_and_counted_once_per_deletion() -> None:
    running = observe(ALL_RUNNING).status
    gone = pod("rollout", 0, disruption="DeletionByPodGC")
    d = _decide_lost([gone], running)
    assert d.create == [("rollout", 0)] and d.delete == []
    assert (d.status.rollout_preemptions, d.status.restarts) == (1, 0)
    assert [(e.type, e.reason, e.message) for e in d.events if e.reason.startswith("Rollout")] == [
        (
            "Normal",
            "RolloutPreempted",
            "rollout pod quickstart-rollout-0 is gone: its node took it away (DeletionByPodGC); "
            "recreating it alone, the trainer keeps going",
        )
    ]
    plain = _decide_lost([pod("rollout", 1)], d.status)  # `kubectl delete pod`, grace 0
    assert plain.status.rollout_preemptions == 2
    assert [e.message for e in plain.events if e.reason == "RolloutPreempted"] == [
        "rollout pod quickstart-rollout-1 is gone: it was deleted, not by lorarl; recreating it "
        "alone, the trainer keeps going"
    ]
    # scaled down meanwhile: a pod beyond the replicas is not replaced nor counted
    assert _decide_lost([pod("rollout", 1)], running, replicas=1).status.rollout_preemptions == 0
    # a vanished trainer pod is not a rollout preemption
    assert _decide_lost([pod("trainer", 0)], running).status.rollout_preemptions == 0


def _pod_body(uid: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "quickstart-rollout-0",
            "uid": uid,
            "labels": {
                builders.JOB_LABEL: "quickstart",
                builders.ROLE_LABEL: "rollout",
                builders.INDEX_LABEL: "0",
            },
        },
        "status": status,
    }


def test_pod_view_reads_the_pod_reason_and_the_disruption_condition() -> None:
    body = _pod_body(
        "u1",
        phase="Failed",
        reason="Terminated",
        message="Pod was terminated in response to imminent node shutdown.",
        conditions=[
            {"type": "Ready", "status": "False"},
            {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"},
        ],
        containerStatuses=[{"state": {"terminated": {"reason": "Error", "exitCode": 143}}}],
    )
    view = pod_view(body)
    assert view is not None
    assert (view.reason, view.pod_reason, view.disruption) == (
        "Error",
        "Terminated",
        "TerminationByKubelet",
    )
    stale = _pod_body("u2", conditions=[{"type": "DisruptionTarget", "status": "False"}])
    assert pod_view(stale).disruption == ""  # type: ignore[union-attr]


def test_the_operators_own_deletes_are_never_lost_pods() -> None:
    state = JobState(uid="j", body={})
    ours = pod_view(_pod_body("mine"))
    theirs = pod_view(_pod_body("theirs"))
    assert ours is not None and theirs is not None
    state.own_deletes["mine"] = 100.0
    state.pod_gone(ours, 101.0)
    state.pod_gone(theirs, 101.0)
    assert list(state.lost) == ["theirs"]
