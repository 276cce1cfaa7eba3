"""decide(): one pure pass from observed pods and status to actions and a new status."""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path

import yaml

from harness.engines.fake_trainer import FakeTrainer
from lorarl.api.reports.status import Condition, LoRARLJobStatus
from lorarl.api.validation import parse_job
from lorarl.operator.decide import Observed, decide, rfc3339
from lorarl.operator.status import PodView

ROOT = Path(__file__).resolve().parents[3]
T0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
BASE = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())


def job(**policy: object):
    doc = copy.deepcopy(BASE)
    doc["spec"]["runPolicy"] = dict(policy)
    return parse_job(doc)


def pod(role: str, i: int, phase: str = "Running", attempt: int = 0, **kw: object) -> PodView:
    return PodView(
        name=f"quickstart-{role}-{i}",
        job="quickstart",
        role=role,
        index=i,
        attempt=attempt,
        phase=phase,
        uid=f"{role}{i}a{attempt}",
        **kw,
    )


ALL_RUNNING = [pod("trainer", 0), pod("rollout", 0), pod("rollout", 1)]


def observe(pods, status=None, now=T0, replicas=None, progress=None, **policy):
    return decide(
        Observed(
            job=job(**policy),
            generation=3,
            status=status or LoRARLJobStatus(),
            replicas=replicas or {"trainer": 1, "rollout": 2},
            pods=pods,
            now=now,
            progress=progress,
        )
    )


def cond(status: LoRARLJobStatus, type_: str) -> Condition:
    return next(c for c in status.conditions if c.type == type_)


def test_fresh_job_creates_every_pod_and_is_pending() -> None:
    d = observe([])
    assert d.create == [("trainer", 0), ("rollout", 0), ("rollout", 1)]
    assert d.delete == [] and d.attempt == 0
    st = d.status
    assert (st.phase, st.start_time, st.total_steps, st.rollout_replicas) == (
        "Pending",
        "2026-01-01T12:00:00Z",
        BASE["spec"]["training"]["totalSteps"],
        2,
    )
    assert st.rollout_selector == "lorarl.dev/job=quickstart,lorarl.dev/role=rollout"
    assert st.observed_generation == 3
    created = cond(st, "Created")
    assert (created.status, created.observed_generation) == ("True", 3)
    assert [(e.reason, e.message) for e in d.events] == [("Pending", "waiting for 3 pods to start")]


def test_phase_follows_pods_and_conditions_keep_their_transition_time() -> None:
    starting = observe(
        [pod("trainer", 0), pod("rollout", 0, "Pending"), pod("rollout", 1, "Pending")]
    )
    assert starting.status.phase == "Starting" and starting.create == []
    assert cond(starting.status, "TrainerReady").status == "True"
    assert cond(starting.status, "RolloutReady").message == "0/2 rollout pods running"
    later = T0 + dt.timedelta(minutes=5)
    running = observe(ALL_RUNNING, status=starting.status, now=later)
    assert running.status.phase == "Running"
    assert cond(running.status, "Running").last_transition_time == rfc3339(later)
    # TrainerReady stayed True: its transition time did not move.
    assert cond(running.status, "TrainerReady").last_transition_time == rfc3339(T0)
    again = observe(ALL_RUNNING, status=running.status, now=later + dt.timedelta(minutes=1))
    assert again.status == running.status and again.events == []  # a no-op pass writes nothing


def test_failed_rollout_is_recreated_alone() -> None:
    pods = [
        pod("trainer", 0),
        pod("rollout", 0),
        pod("rollout", 1, "Failed", reason="Error", message="boom", exit_code=2),
    ]
    d = observe(pods, status=observe(ALL_RUNNING).status)
    assert d.delete == ["quickstart-rollout-1"]
    assert d.create == [("rollout", 1)]
    assert d.status.restarts == 0 and not d.restarted
    assert d.status.phase == "Starting"
    assert [e.message for e in d.events if e.reason == "RolloutRestart"] == [
        "rollout pod quickstart-rollout-1 ended (Error, exit code 2): boom; recreating it alone, "
        "the trainer keeps going"
    ]


def test_trainer_failure_restarts_the_group_once_and_counts_it() -> None:
    pods = [
        pod("trainer", 0),
        pod("trainer", 1, "Failed", reason="OOMKilled", exit_code=137),
        pod("rollout", 0),
        pod("rollout", 1),
    ]
    d = observe(pods, replicas={"trainer": 2, "rollout": 2})
    assert d.restarted and d.status.restarts == 1 and d.attempt == 1
    assert d.delete == ["quickstart-trainer-0", "quickstart-trainer-1"]
    assert d.create == [("trainer", 0), ("trainer", 1)]
    assert d.status.phase == "Restarting"
    # The next pass still sees the old failed pod (attempt 0): history, not a second restart.
    again = observe(pods, status=d.status, replicas={"trainer": 2, "rollout": 2})
    assert again.status.restarts == 1 and not again.restarted
    assert set(again.delete) == {"quickstart-trainer-0", "quickstart-trainer-1"}
    # New pods come up: Restarting until the whole group runs, then Running.
    fresh = [
        pod("trainer", 0, attempt=1),
        pod("trainer", 1, "Pending", attempt=1),
        pod("rollout", 0),
        pod("rollout", 1),
    ]
    assert (
        observe(fresh, status=d.status, replicas={"trainer": 2, "rollout": 2}).status.phase
        == "Restarting"
    )
    fresh[1] = pod("trainer", 1, attempt=1)
    assert (
        observe(fresh, status=d.status, replicas={"trainer": 2, "rollout": 2}).status.phase
        == "Running"
    )


def test_backoff_limit_fails_with_the_pods_reason_and_message() -> None:
    status = LoRARLJobStatus(phase="Running", restarts=2, start_time=rfc3339(T0))
    pods = [
        pod(
            "trainer",
            0,
            "Failed",
            attempt=2,
            reason="OOMKilled",
            message="out of memory",
            exit_code=137,
        ),
        pod("rollout", 0),
        pod("rollout", 1),
    ]
    d = observe(pods, status=status, backoffLimit=2)
    failed = cond(d.status, "Failed")
    assert (d.status.phase, failed.reason) == ("Failed", "OOMKilled")
    assert failed.message == (
        "trainer pod quickstart-trainer-0 failed (OOMKilled, exit code "
        "137): out of memory; backoffLimit (2) reached after 2 restarts"
    )
    assert d.status.completion_time == rfc3339(T0)
    # the default cleanPodPolicy (Running) keeps the failed pod for `kubectl logs`
    assert d.delete == ["quickstart-rollout-0", "quickstart-rollout-1"]
    assert observe(pods, status=status, backoffLimit=2, cleanPodPolicy="All").delete == [
        p.name for p in pods
    ]
    assert [e.type for e in d.events if e.reason == "Failed"] == ["Warning"]
    odd = [pod("trainer", 0, "Failed", reason="exit status 1 (weird)")]
    assert cond(observe(odd, backoffLimit=0).status, "Failed").reason == "TrainerFailed"


def test_deadline_counts_from_start_and_stops_running_pods() -> None:
    status = observe(ALL_RUNNING).status
    assert (
        observe(
            ALL_RUNNING, status=status, now=T0 + dt.timedelta(seconds=59), activeDeadlineSeconds=60
        ).status.phase
        == "Running"
    )
    pods = [*ALL_RUNNING[:2], pod("rollout", 1, "Succeeded")]
    d = observe(
        pods,
        status=status,
        now=T0 + dt.timedelta(seconds=60),
        activeDeadlineSeconds=60,
        cleanPodPolicy="None",
    )
    assert (d.status.phase, cond(d.status, "Failed").reason) == ("Failed", "DeadlineExceeded")
    assert d.delete == ["quickstart-trainer-0", "quickstart-rollout-0"]  # finished one kept


def test_success_cleans_by_policy_and_ttl_deletes_the_job() -> None:
    pods = [pod("trainer", 0, "Succeeded"), pod("rollout", 0), pod("rollout", 1)]
    by_policy = {p: observe(pods, cleanPodPolicy=p).delete for p in ("All", "Running", "None")}
    assert by_policy == {
        "All": [p.name for p in pods],
        "Running": ["quickstart-rollout-0", "quickstart-rollout-1"],
        "None": [],
    }
    done = observe(pods, ttlSecondsAfterFinished=30)
    assert done.status.phase == "Succeeded" and cond(done.status, "Succeeded").status == "True"
    assert not observe(
        [], status=done.status, now=T0 + dt.timedelta(seconds=29), ttlSecondsAfterFinished=30
    ).delete_job
    assert observe(
        [], status=done.status, now=T0 + dt.timedelta(seconds=30), ttlSecondsAfterFinished=30
    ).delete_job
    assert not observe([], status=done.status, now=T0 + dt.timedelta(days=9)).delete_job


def test_suspend_then_resume() -> None:
    running = observe(ALL_RUNNING).status
    d = observe(ALL_RUNNING, status=running, suspend=True)
    assert set(d.delete) == {p.name for p in ALL_RUNNING} and d.create == []
    assert (d.status.phase, d.status.rollout_replicas) == ("Suspended", 0)
    assert cond(d.status, "Suspended").status == "True"
    later = T0 + dt.timedelta(hours=1)
    resumed = observe([], status=d.status, now=later)
    assert resumed.create == [("trainer", 0), ("rollout", 0), ("rollout", 1)]
    assert (resumed.status.phase, resumed.status.start_time) == ("Pending", rfc3339(T0))
    assert (resumed.status.active_since, resumed.status.active_seconds) == (rfc3339(later), 0)
    assert (cond(resumed.status, "Suspended").status, cond(resumed.status, "Suspended").reason) == (
        "False",
        "Resumed",
    )
    assert resumed.status.restarts == 0


def test_the_deadline_clock_stops_while_suspended_and_keeps_what_it_counted() -> None:
    deadline = {"activeDeadlineSeconds": 60}
    ran = observe(ALL_RUNNING, **deadline).status  # admitted at T0
    at = T0 + dt.timedelta(seconds=50)
    paused = observe(ALL_RUNNING, status=ran, now=at, suspend=True, **deadline).status
    assert (paused.phase, paused.active_seconds, paused.active_since) == ("Suspended", 50, None)
    # Suspended for two hours: far past the deadline on the wall clock, but no running time.
    back = at + dt.timedelta(hours=2)
    resumed = observe([], status=paused, now=back, **deadline)
    assert resumed.status.phase == "Pending" and resumed.create
    st = resumed.status
    assert (
        observe(ALL_RUNNING, status=st, now=back + dt.timedelta(seconds=9), **deadline).status.phase
        == "Running"
    )
    late = observe(ALL_RUNNING, status=st, now=back + dt.timedelta(seconds=10), **deadline)
    assert (late.status.phase, cond(late.status, "Failed").reason) == (
        "Failed",
        "DeadlineExceeded",
    )
    assert (late.status.active_seconds, late.status.active_since) == (60, None)


def test_a_job_queued_past_its_deadline_starts_its_clock_when_admitted() -> None:
    """Kueue holds a queued job's pods with a scheduling gate: waiting is not running."""
    policy = {"activeDeadlineSeconds": 60}
    queued_doc = copy.deepcopy(BASE)
    queued_doc["spec"]["runPolicy"] = policy
    queued_doc["spec"]["scheduling"] = {"queueName": "team-q"}
    queued_job = parse_job(queued_doc)

    def at(seconds: float, pods, status):
        return decide(
            Observed(
                job=queued_job,
                generation=1,
                status=status,
                replicas={"trainer": 1, "rollout": 2},
                pods=pods,
                now=T0 + dt.timedelta(seconds=seconds),
            )
        )

    first = at(0, [], LoRARLJobStatus())  # creates the pods; Kueue gates them
    assert first.create and first.status.active_since is None and first.status.start_time is None
    gated = [pod("trainer", 0, "Pending", gated=True), *(pod("rollout", i, "Pending", gated=True)
                                                       for i in (0, 1))]  # fmt: skip
    waiting = at(3600, gated, first.status)
    assert waiting.status.phase == "Pending" and waiting.status.active_since is None
    admitted = at(7200, ALL_RUNNING, waiting.status)
    assert admitted.status.phase == "Running"
    assert (
        admitted.status.start_time
        == admitted.status.active_since
        == rfc3339(T0 + dt.timedelta(seconds=7200))
    )
    assert at(7259, ALL_RUNNING, admitted.status).status.phase == "Running"
    assert at(7260, ALL_RUNNING, admitted.status).status.phase == "Failed"


def test_scaling_adds_and_removes_rollout_pods() -> None:
    up = observe(ALL_RUNNING, replicas={"trainer": 1, "rollout": 3})
    assert up.create == [("rollout", 2)] and up.status.rollout_replicas == 3
    down = observe(ALL_RUNNING, replicas={"trainer": 1, "rollout": 1})
    assert down.delete == ["quickstart-rollout-1"] and down.status.rollout_replicas == 1
    assert down.status.phase == "Running"


def test_terminating_pod_blocks_its_name_until_gone() -> None:
    pods = [pod("trainer", 0, deleting=True), pod("rollout", 0), pod("rollout", 1)]
    assert observe(pods).create == []


def test_progress_lands_in_status() -> None:
    with FakeTrainer(job="quickstart", total_steps=20) as trainer:
        trainer.step(4)
        progress = trainer.progress
    st = observe(ALL_RUNNING, progress=progress).status
    assert (st.step, st.total_steps) == (4, 20)
    assert st.metrics.reward_mean == 0.4 and st.metrics.kl == 0.016
    assert (st.last_sync.version, st.last_sync.bytes) == (4, 4000)
