"""Pod views, termination reasons and metav1.Condition bookkeeping."""

from __future__ import annotations

from lorarl.operator.status import pod_view, reason_word, set_condition, termination

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
