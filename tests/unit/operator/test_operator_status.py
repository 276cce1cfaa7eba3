"""Pod views, termination reasons, metav1.Condition bookkeeping and progress -> status."""

from __future__ import annotations

from pathlib import Path

import yaml

from lorarl.api.reports.progress import Progress, StepRecord
from lorarl.api.reports.status import LoRARLJobStatus, StepMetrics
from lorarl.operator.status import (
    apply_progress,
    pod_view,
    reason_word,
    set_condition,
    termination,
)
from lorarl.server.views import status_from_progress

ROOT = Path(__file__).resolve().parents[3]

LABELS = {
    "lorarl.dev/job": "j",
    "lorarl.dev/role": "trainer",
    "lorarl.dev/replica-index": "1",
    "lorarl.dev/attempt": "2",
}


def test_pod_view_reads_labels_phase_and_deletion() -> None:
    view = pod_view(
        {
            "metadata": {
                "name": "j-trainer-1",
                "uid": "u",
                "labels": LABELS,
                "deletionTimestamp": "2026-01-01T00:00:00Z",
            },
            "status": {"phase": "Running"},
        }
    )
    assert view is not None
    assert (
        view.job,
        view.role,
        view.index,
        view.attempt,
        view.phase,
        view.deleting,
        view.running,
    ) == ("j", "trainer", 1, 2, "Running", True, False)
    assert pod_view({"metadata": {"name": "x", "labels": {"lorarl.dev/job": "j"}}}) is None
    bad = {**LABELS, "lorarl.dev/replica-index": "one"}
    assert pod_view({"metadata": {"name": "x", "labels": bad}}) is None
    assert pod_view({"metadata": {"name": "x", "labels": LABELS}}).phase == "Pending"
    assert pod_view({"metadata": {"name": "x", "labels": LABELS}}).gated is False
    gate = {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}
    assert pod_view({"metadata": {"name": "x", "labels": LABELS}, "spec": gate}).gated is True


def test_termination_prefers_the_failed_container() -> None:
    status = {
        "containerStatuses": [
            {"name": "sidecar", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}},
            {
                "name": "engine",
                "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled", "message": "oom"}},
            },
        ]
    }
    assert termination(status) == ("OOMKilled", "oom", 137)
    assert termination({"containerStatuses": [{"state": {"running": {}}}]}) == ("", "", None)
    evicted = pod_view(
        {
            "metadata": {"name": "x", "labels": LABELS},
            "status": {"phase": "Failed", "reason": "Evicted", "message": "node low on memory"},
        }
    )
    assert (evicted.reason, evicted.message) == ("Evicted", "node low on memory")


def test_set_condition_moves_transition_time_only_on_flips() -> None:
    conds = set_condition([], "Running", True, "A", "m1", "t1", 1)
    conds = set_condition(conds, "Running", True, "B", "m2", "t2", 2)
    assert [
        (c.status, c.reason, c.message, c.last_transition_time, c.observed_generation)
        for c in conds
    ] == [("True", "B", "m2", "t1", 2)]
    conds = set_condition(conds, "Running", False, "C", "m3", "t3", 2)
    assert conds[0].last_transition_time == "t3"
    conds = set_condition(conds, "Failed", True, "X", "y" * 5000, "t4", 2)
    assert [c.type for c in conds] == ["Running", "Failed"] and len(conds[1].message) == 1024


def test_reason_word() -> None:
    assert reason_word("OOMKilled", "F") == "OOMKilled"
    assert reason_word("exit 1", "F") == "F"
    assert reason_word("", "F") == "F"


def _progress(**latest) -> Progress:
    record = {"step": 3, "time": 1.0, "reward_mean": 0.5, **latest}
    return Progress(job="j", phase="Running", step=3, total_steps=10, latest=record)


def test_correctness_metrics_reach_the_status_and_its_json() -> None:
    """The trainer's RL-correctness metrics are what a person watching `kubectl get -o yaml` (or
    the API's job detail, built from the same model) needs to see a mismatched engine."""
    reported = {
        "logprob_mismatch": 0.02, "logprob_mismatch_p50": 0.01, "logprob_mismatch_p90": 0.05,
        "logprob_mismatch_p99": 0.3, "tis_clip_frac": 0.04, "clip_fraction": 0.1,
        "clip_fraction_first_update": 0.0, "truncated_fraction": 0.25,
        "response_length_mean": 17.5, "weight_version": 2,
    }  # fmt: skip
    status = apply_progress(LoRARLJobStatus(), _progress(**reported))
    assert status.metrics is not None
    assert {k: getattr(status.metrics, k) for k in reported} == reported
    dumped = status.model_dump(by_alias=True, exclude_none=True)["metrics"]
    assert dumped["tisClipFrac"] == 0.04 and dumped["logprobMismatchP99"] == 0.3
    assert dumped["truncatedFraction"] == 0.25 and dumped["weightVersion"] == 2
    # The REST API's job detail of a local run is built from the progress with the same model.
    detail = status_from_progress(_progress(**reported)).metrics
    assert detail is not None and {k: getattr(detail, k) for k in reported} == reported
    # A trainer that does not report them leaves them unset, not zero.
    bare = apply_progress(LoRARLJobStatus(), _progress()).metrics
    assert bare is not None and bare.tis_clip_frac is None and bare.reward_mean == 0.5


def test_every_status_metric_is_a_progress_metric() -> None:
    """apply_progress copies by field name: a status metric the trainer never reports would stay
    empty forever."""
    assert set(StepMetrics.model_fields) <= set(StepRecord.model_fields)


def test_crd_status_schema_has_the_correctness_metrics() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "lorarljobs.lorarl.dev.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    metrics = schema["properties"]["status"]["properties"]["metrics"]["properties"]
    for key in ("tisClipFrac", "logprobMismatchP90", "logprobMismatchP99", "truncatedFraction"):
        assert key in metrics, key


def test_ppo_critic_metrics_reach_the_status_and_the_crd() -> None:
    """ppo's critic health (value loss, explained variance) and the in-reward KL beta are read
    from the status like the other metrics; other algorithms leave them unset."""
    reported = {
        "value_loss": 0.12, "value_clip_fraction": 0.03, "explained_variance": 0.4,
        "value_mean": 0.55, "critic_grad_norm": 2.5, "kl_coef": 0.011, "kl_in_reward": 0.07,
    }  # fmt: skip
    status = apply_progress(LoRARLJobStatus(), _progress(**reported))
    assert {k: getattr(status.metrics, k) for k in reported} == reported
    dumped = status.model_dump(by_alias=True, exclude_none=True)["metrics"]
    assert dumped["explainedVariance"] == 0.4 and dumped["klInReward"] == 0.07
    detail = status_from_progress(_progress(**reported)).metrics
    assert {k: getattr(detail, k) for k in reported} == reported
    assert apply_progress(LoRARLJobStatus(), _progress()).metrics.value_loss is None
    crd = yaml.safe_load((ROOT / "crds" / "lorarljobs.lorarl.dev.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    metrics = schema["properties"]["status"]["properties"]["metrics"]["properties"]
    for key in ("valueLoss", "valueClipFraction", "explainedVariance", "valueMean",
                "criticGradNorm", "klCoef", "klInReward"):  # fmt: skip
        assert key in metrics, key
