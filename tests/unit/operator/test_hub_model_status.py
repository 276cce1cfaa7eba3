"""status.model.revision: the commit a hub id job's first fetch-model reports is pinned for the
job; a pod that loaded another commit fails the job; a failed fetch is the pod's reason."""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path

import yaml

from lorarl.api.reports.status import LoRARLJobStatus, ModelStatus
from lorarl.api.validation import parse_job
from lorarl.operator.builders import ATTEMPT_LABEL, INDEX_LABEL, JOB_LABEL, ROLE_LABEL
from lorarl.operator.decide import Observed, decide
from lorarl.operator.status import pod_view

ROOT = Path(__file__).resolve().parents[3]
BASE = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
T0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
A, B = "a" * 40, "b" * 40


def hub_job():
    doc = copy.deepcopy(BASE)
    doc["spec"]["model"] = {"path": "Qwen/Qwen3-0.6B"}
    return parse_job(doc, cluster=True)


def pod(role: str, i: int, *, fetched: str | None = None, phase: str = "Running", init=None):
    """A pod object as the API server returns it, with its fetch-model's status."""
    status: dict = {"phase": phase}
    if fetched is not None:
        init = {"exitCode": 0, "reason": "Completed", "message": fetched}
    if init is not None:
        status["initContainerStatuses"] = [
            {"name": "fetch-model", "state": {"terminated": init}, "restartCount": 0}
        ]
    labels = {JOB_LABEL: "quickstart", ROLE_LABEL: role, INDEX_LABEL: str(i), ATTEMPT_LABEL: "0"}
    view = pod_view(
        {
            "metadata": {"name": f"quickstart-{role}-{i}", "uid": f"{role}{i}", "labels": labels},
            "status": status,
        }
    )
    assert view is not None
    return view


def observe(pods, status=None):
    return decide(
        Observed(
            job=hub_job(),
            generation=1,
            status=status or LoRARLJobStatus(),
            replicas={"trainer": 1, "rollout": 2},
            pods=pods,
            now=T0,
        )
    )


def test_the_first_fetched_commit_is_pinned_in_the_status():
    d = observe([pod("trainer", 0, fetched=A), pod("rollout", 0, phase="Pending")])
    assert d.status.model == ModelStatus(source="Qwen/Qwen3-0.6B", revision=A)
    assert (d.events[0].reason, A in d.events[0].message) == ("ModelFetched", True)
    # the pods still to make are created (the reconciler pins their fetch to the status' commit)
    assert d.create == [("rollout", 1)]
    again = observe([pod("trainer", 0, fetched=A), pod("rollout", 0, fetched=A)], d.status)
    assert again.status.phase != "Failed" and again.status.model == d.status.model


def test_a_pod_that_loaded_another_commit_fails_the_job_with_what_to_do():
    pinned = LoRARLJobStatus(model=ModelStatus(source="Qwen/Qwen3-0.6B", revision=A))
    d = observe([pod("trainer", 0, fetched=A), pod("rollout", 0, fetched=B)], pinned)
    assert d.status.phase == "Failed"
    failed = next(c for c in d.status.conditions if c.type == "Failed")
    assert failed.reason == "ModelRevisionMismatch"
    assert "quickstart-rollout-0" in failed.message and "spec.model.revision" in failed.message
    assert "quickstart-rollout-0" in d.delete  # stopped: it serves other weights


def test_a_message_that_is_not_a_commit_pins_nothing():
    d = observe([pod("trainer", 0, fetched="downloaded 3 files")])
    assert d.status.model is None


def test_a_failed_fetch_is_why_the_pod_failed():
    line = "spec.model.path: cannot download Qwen/Qwen3-0.6B@main from https://huggingface.co"
    view = pod(
        "trainer", 0, phase="Failed", init={"exitCode": 1, "reason": "Error", "message": line}
    )
    assert (view.reason, view.message, view.exit_code) == ("Error", line, 1)
    d = observe([view])
    assert any(line in e.message for e in d.events)
