"""A finished trainer's last steps reach the job's status through its termination message: the
progress endpoint is gone with the process, so without it `kubectl get lrj` of a finished job
shows the step of the operator's last poll, not the last step (seen under the process kubelet:
Step 22 of 30)."""

from __future__ import annotations

from lorarl.api.reports.progress import Progress, StepRecord
from lorarl.api.reports.status import LoRARLJobStatus
from lorarl.operator.status import final_progress, pod_view
from tests.unit.operator.test_operator_decide import observe, pod


def report(step: int, reward: float) -> str:
    latest = StepRecord(step=step, time=1.0e9, reward_mean=reward)
    progress = Progress(job="quickstart", phase="Succeeded", step=step, total_steps=30,
                        latest=latest, adapter_path="/outputs/quickstart/adapter")  # fmt: skip
    return progress.model_dump_json(by_alias=True, exclude_none=True)


def test_succeeded_trainer_reports_its_last_step() -> None:
    polled = Progress(job="quickstart", phase="Running", step=22, total_steps=30)
    done = pod("trainer", 0, "Succeeded", message=report(30, 0.75), exit_code=0)
    d = observe([done, pod("rollout", 0), pod("rollout", 1)], progress=polled)
    assert d.status.phase == "Succeeded"
    assert (d.status.step, d.status.metrics.reward_mean) == (30, 0.75)
    assert d.status.adapter_path == "/outputs/quickstart/adapter"


def test_a_log_tail_is_not_a_report() -> None:
    assert final_progress("") is None
    assert final_progress("Traceback (most recent call last):\n ...") is None
    assert final_progress('{"not": "a report"}') is None
    polled = Progress(job="quickstart", phase="Running", step=22, total_steps=30)
    done = pod("trainer", 0, "Succeeded", message="bye", exit_code=0)
    d = observe([done], progress=polled, status=LoRARLJobStatus(phase="Running"))
    assert d.status.step == 22  # what was polled stays


def test_the_message_is_read_from_the_trainer_container() -> None:
    body = {
        "metadata": {"name": "quickstart-trainer-0", "labels": {
            "lorarl.dev/job": "quickstart", "lorarl.dev/role": "trainer",
            "lorarl.dev/replica-index": "0"}},
        "status": {"phase": "Succeeded", "containerStatuses": [{"name": "trainer", "state": {
            "terminated": {"exitCode": 0, "reason": "Completed", "message": report(30, 0.5)}}}]},
    }  # fmt: skip
    view = pod_view(body)
    assert view is not None and final_progress(view.message).step == 30


def test_later_passes_keep_the_final_step() -> None:
    """The pass after the one that finished the job (pod deletions, the timer) still holds the
    last poll's report: it must not take the job back to step 22 (seen: Step 28 of 30)."""
    polled = Progress(job="quickstart", phase="Running", step=22, total_steps=30)
    done = pod("trainer", 0, "Succeeded", message=report(30, 0.75), exit_code=0)
    first = observe([done, pod("rollout", 0), pod("rollout", 1)], progress=polled)
    assert first.status.step == 30
    again = observe([done], progress=polled, status=first.status)
    assert (again.status.phase, again.status.step) == ("Succeeded", 30)
    assert again.status.metrics.reward_mean == 0.75
