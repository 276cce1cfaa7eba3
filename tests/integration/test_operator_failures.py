"""Failures, deadlines, suspend/resume, success and TTL, and an operator killed mid-reconcile."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

from harness.cluster.admission import admission_webhook, allow, deny
from harness.cluster.controlplane import ControlPlane
from tests.integration.test_operator_harness import (
    LRJ,
    Cluster,
    cluster,
    quickstart,
    remove_podgroup_crd,
    shared,
    wait_for,
)

__all__ = ["shared"]


def _uids(c: Cluster, name: str) -> dict[str, str]:
    return {n: p["metadata"]["uid"] for n, p in c.pods(name).items()}


def _start(c: Cluster, name: str, trainers: int = 1, **overrides: object) -> dict[str, str]:
    c.create(quickstart(name, trainer__replicas=trainers, **overrides))
    c.wait_pods(
        name,
        {f"{name}-trainer-{i}" for i in range(trainers)}
        | {f"{name}-rollout-0", f"{name}-rollout-1"},
    )
    c.run_all(name)
    c.wait_phase(name, "Running")
    return _uids(c, name)


def test_failed_rollout_pod_is_recreated_alone(shared: Cluster) -> None:
    before = _start(shared, "rf")
    shared.kube.set_pod_phase(
        shared.namespace,
        "rf-rollout-1",
        "Failed",
        exit_code=1,
        reason="Error",
        message="engine crashed",
    )
    wait_for(lambda: _uids(shared, "rf").get("rf-rollout-1") not in (None, before["rf-rollout-1"]))
    after = _uids(shared, "rf")
    assert after["rf-trainer-0"] == before["rf-trainer-0"]
    assert after["rf-rollout-0"] == before["rf-rollout-0"]
    assert shared.status("rf")["restarts"] == 0
    shared.wait_event(
        "rf",
        "RolloutRestart",
        "rf-rollout-1 ended (Error, exit code 1): engine crashed; recreating it alone",
    )
    wait_for(lambda: shared.status("rf").get("rolloutRestarts") == 1)
    # A rollout pod that disappears (a node gone, `kubectl delete`) comes back too: a
    # preemption, counted apart from failures and never a trainer restart.
    shared.kube.delete("v1/pods", shared.namespace, "rf-rollout-0")
    wait_for(lambda: "rf-rollout-0" in shared.pods("rf"))
    assert _uids(shared, "rf")["rf-trainer-0"] == before["rf-trainer-0"]
    assert (
        shared.wait_event(
            "rf", "RolloutPreempted", "rf-rollout-0 is gone: it was deleted, not by lorarl"
        )[0]
        == "Normal"
    )
    wait_for(lambda: shared.status("rf").get("rolloutPreemptions") == 1)
    # Evicted by its node: recreated alone with a Normal event, counted once.
    evicted = _uids(shared, "rf")["rf-rollout-1"]
    shared.kube.set_pod_phase(
        shared.namespace, "rf-rollout-1", "Failed", exit_code=143, reason="Evicted"
    )
    wait_for(lambda: _uids(shared, "rf").get("rf-rollout-1") not in (None, evicted))
    shared.wait_event("rf", "RolloutPreempted", "rf-rollout-1 was preempted (Evicted)")
    wait_for(lambda: shared.status("rf").get("rolloutPreemptions") == 2)
    status = shared.status("rf")
    assert (status["restarts"], status["rolloutRestarts"]) == (0, 1)
    assert _uids(shared, "rf")["rf-trainer-0"] == before["rf-trainer-0"]


def test_trainer_failure_restarts_the_group_until_backoff_limit(shared: Cluster) -> None:
    before = _start(shared, "tf", trainers=2, runPolicy={"backoffLimit": 1})
    assert set(before) >= {"tf-trainer-0", "tf-trainer-1"}
    shared.kube.set_pod_phase(
        shared.namespace,
        "tf-trainer-1",
        "Failed",
        exit_code=137,
        reason="OOMKilled",
        message="out of memory",
    )
    wait_for(lambda: shared.status("tf").get("restarts") == 1)
    wait_for(
        lambda: all(
            _uids(shared, "tf").get(f"tf-trainer-{i}") not in (None, before[f"tf-trainer-{i}"])
            for i in (0, 1)
        )
    )
    pods = shared.pods("tf")
    assert {
        pods[f"tf-trainer-{i}"]["metadata"]["labels"]["lorarl.dev/attempt"] for i in (0, 1)
    } == {"1"}
    assert _uids(shared, "tf")["tf-rollout-0"] == before["tf-rollout-0"]  # rollouts untouched
    assert shared.status("tf")["phase"] == "Restarting"
    shared.run_all("tf")
    shared.wait_phase("tf", "Running")

    shared.kube.set_pod_phase(
        shared.namespace,
        "tf-trainer-0",
        "Failed",
        exit_code=1,
        reason="Error",
        message="loss is NaN",
    )
    status = shared.wait_phase("tf", "Failed")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "Error"
    assert "tf-trainer-0 failed (Error, exit code 1): loss is NaN" in failed["message"]
    assert "backoffLimit (1) reached after 1 restarts" in failed["message"]
    assert status["restarts"] == 1 and status["completionTime"]
    # The default cleanPodPolicy (Running) stops the running pods and keeps the failed one.
    wait_for(
        lambda: set(shared.pods("tf")) == {"tf-trainer-0"},
        what="running pods cleaned, the failed trainer kept for `kubectl logs`",
    )
    shared.wait_event(
        "tf",
        "TrainerRestart",
        "tf-trainer-1 failed (OOMKilled, exit code 137): "
        "out of memory; restarting the trainer group",
    )
    assert shared.wait_event("tf", "Failed")[0] == "Warning"
    assert "lorarl_trainer_restarts_total" in shared.operator.metrics()


def test_active_deadline_fails_the_job(shared: Cluster) -> None:
    _start(shared, "late", runPolicy={"activeDeadlineSeconds": 2, "cleanPodPolicy": "None"})
    status = shared.wait_phase("late", "Failed", timeout=10)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DeadlineExceeded"
    assert "activeDeadlineSeconds (2s)" in failed["message"]
    # Running pods are stopped at the deadline even when cleanPodPolicy keeps finished ones.
    wait_for(lambda: shared.pods("late") == {})


def test_a_job_created_suspended_waits_without_pods_until_resumed(shared: Cluster) -> None:
    """As Kueue creates jobs: the create handler's pass alone holds it (the suspend handler runs
    on updates only), and un-suspending starts the pods."""
    shared.create(quickstart("queued", runPolicy={"suspend": True}))
    status = shared.wait_phase("queued", "Suspended")
    assert any(c["type"] == "Suspended" and c["status"] == "True" for c in status["conditions"])
    assert shared.kube.get("v1/configmaps", shared.namespace, "queued-config") is not None
    time.sleep(0.5)  # past the pod debounce: still none
    assert shared.pods("queued") == {}
    shared.kube.patch(LRJ, shared.namespace, "queued", {"spec": {"runPolicy": {"suspend": False}}})
    shared.wait_pods("queued", {"queued-trainer-0", "queued-rollout-0", "queued-rollout-1"})


def test_suspend_deletes_pods_and_resume_recreates_them(shared: Cluster) -> None:
    _start(shared, "nap")
    shared.kube.patch(LRJ, shared.namespace, "nap", {"spec": {"runPolicy": {"suspend": True}}})
    status = shared.wait_phase("nap", "Suspended")
    wait_for(lambda: shared.pods("nap") == {})
    assert any(c["type"] == "Suspended" and c["status"] == "True" for c in status["conditions"])
    assert shared.kube.get("v1/configmaps", shared.namespace, "nap-config") is not None
    shared.kube.patch(LRJ, shared.namespace, "nap", {"spec": {"runPolicy": {"suspend": False}}})
    shared.wait_pods("nap", {"nap-trainer-0", "nap-rollout-0", "nap-rollout-1"})
    status = shared.wait_phase("nap", "Pending")
    suspended = next(c for c in status["conditions"] if c["type"] == "Suspended")
    assert (suspended["status"], suspended["reason"]) == ("False", "Resumed")
    assert status["restarts"] == 0
    shared.wait_event("nap", "Suspended")
    shared.wait_event("nap", "Resumed")


def test_success_cleans_pods_by_policy_and_ttl_deletes_the_job(shared: Cluster) -> None:
    _start(shared, "done", runPolicy={"cleanPodPolicy": "Running", "ttlSecondsAfterFinished": 4})
    shared.kube.set_pod_phase(shared.namespace, "done-trainer-0", "Succeeded")
    status = shared.wait_phase("done", "Succeeded")
    assert status["completionTime"]
    assert any(c["type"] == "Succeeded" and c["status"] == "True" for c in status["conditions"])
    # cleanPodPolicy Running deletes the engines but keeps the finished trainer pod (for logs).
    wait_for(lambda: set(shared.pods("done")) == {"done-trainer-0"}, 4, "engines cleaned")
    # 4 s after it finished (3-4 s here on a quiet machine). Like Kubernetes' own TTL controller
    # it is best-effort: the bound leaves room for a loaded 2-core machine, where the delete
    # waits for kopf's finalizer pass, and for one retry of the timer after an unexpected error
    # (kopf's default: 60 s). A miss says what the job and the operator were doing.
    try:
        wait_for(lambda: shared.job("done") is None, 75, "TTL deletion")
    except AssertionError as exc:
        job = shared.job("done") or {}
        raise AssertionError(
            f"{exc}; metadata {job.get('metadata')}; status {job.get('status')}; events "
            f"{shared.events('done')}; operator log:\n{shared.operator.logs()}"
        ) from exc
    # ... until the job goes: the garbage collector takes its pods with it.
    wait_for(lambda: shared.pods("done") == {}, 60, "pods collected with the job")


def test_operator_killed_mid_reconcile_creates_nothing_twice(
    cp: ControlPlane, tmp_path: Path
) -> None:
    ns = "crash-ns"
    reached, killed = threading.Event(), threading.Event()
    creates: list[str] = []

    def slow_second_pod(review: dict) -> dict:
        """The API server has the request; the operator dies before it hears back."""
        creates.append(review["request"]["name"])
        if len(creates) == 2 and not reached.is_set():
            reached.set()
            killed.wait(10)
        return allow(review)

    with cluster(cp, tmp_path, namespace=ns, webhook=False) as c:
        hook = admission_webhook(cp, slow_second_pod, name="slow", resources=["pods"], namespace=ns)
        with hook:
            c.create(quickstart("crash"))
            assert reached.wait(15), "the operator never created a second pod"
            c.operator.kill()
            killed.set()
            # The held create dies with its client (the API server cancels a request whose
            # caller went away); the others committed.
            time.sleep(0.5)
            secret = c.kube.get("v1/secrets", ns, "crash-engine-key")
            assert secret is not None
            before = _uids(c, "crash")
            assert 1 <= len(before) <= 3, before

            c.operator.start()
            c.wait_pods("crash", {"crash-trainer-0", "crash-rollout-0", "crash-rollout-1"})
            c.run_all("crash")
            c.wait_phase("crash", "Running")
            after = _uids(c, "crash")
            assert {n: after[n] for n in before} == before  # nothing re-created
            # Every pod created once: the restarted operator may ask again for a name that is
            # taken (a real API server runs admission before it finds the name taken, then
            # answers 409), but no pod was made twice or replaced.
            assert set(creates) == set(after)
            kept = c.kube.get("v1/secrets", ns, "crash-engine-key")
            assert kept["metadata"]["uid"] == secret["metadata"]["uid"]
            assert kept.get("data") == secret.get("data")
            assert len(c.kube.list_objects("v1/services", ns)) == 1


def test_a_child_the_api_server_refuses_fails_the_job_with_its_message(shared: Cluster) -> None:
    """422 Invalid is final: the job fails with the API server's words (condition and Event)
    instead of retrying the same create every 2 s forever."""
    message = 'spec.containers[0].resources.limits[memory]: Invalid value: "16GB"'

    def refuse(review: dict) -> dict:
        request = review["request"]
        labels = (request.get("object") or {}).get("metadata", {}).get("labels") or {}
        if labels.get("lorarl.dev/job") != "refused":
            return allow(review)
        return deny(review, 422, "Invalid", message)

    with admission_webhook(
        shared.kube.cp, refuse, name="refuse", resources=["pods"], namespace=shared.namespace
    ):
        shared.create(quickstart("refused"))
        status = shared.wait_phase("refused", "Failed")
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "ChildRejected"
        assert failed["message"].startswith("422 Invalid: creating Pod refused-")
        assert message in failed["message"]
        shared.wait_event("refused", "ChildRejected", message)
        assert shared.pods("refused") == {}
        time.sleep(1.0)  # several timer periods: the failure is final, nothing retries
        assert shared.status("refused")["phase"] == "Failed" and shared.pods("refused") == {}


def test_a_terminating_pod_is_waited_for_before_it_is_recreated(shared: Cluster) -> None:
    """A real API server keeps a deleted pod's name while it terminates (graceful deletion, or a
    finalizer as here): re-creating it answers 409 AlreadyExists. The operator retries until the
    name is free and never counts the terminating pod as the new one."""
    before = _start(shared, "term")
    hold = {"metadata": {"finalizers": ["test.lorarl.dev/hold"]}}
    shared.kube.patch("v1/pods", shared.namespace, "term-rollout-1", hold)
    shared.kube.set_pod_phase(
        shared.namespace, "term-rollout-1", "Failed", exit_code=1, reason="Error"
    )
    # The operator deletes it; the finalizer keeps it terminating under the same name.
    wait_for(
        lambda: (
            (shared.kube.get("v1/pods", shared.namespace, "term-rollout-1") or {})
            .get("metadata", {})
            .get("deletionTimestamp")
        ),
        10,
        "the failed rollout pod terminating",
    )
    time.sleep(2.0)  # several reconcile passes (timer 0.3 s): each create is refused
    held = shared.kube.get("v1/pods", shared.namespace, "term-rollout-1")
    assert held is not None and held["metadata"]["uid"] == before["term-rollout-1"]
    assert "term-rollout-1" not in shared.pods("term")  # terminating: not counted as running
    assert shared.status("term")["phase"] != "Failed"
    # The name frees up: the operator creates the new pod.
    shared.kube.patch(
        "v1/pods", shared.namespace, "term-rollout-1", {"metadata": {"finalizers": None}}
    )
    wait_for(
        lambda: _uids(shared, "term").get("term-rollout-1") not in (None, before["term-rollout-1"]),
        20,
        "term-rollout-1 re-created once its name is free",
    )
    assert _uids(shared, "term")["term-trainer-0"] == before["term-trainer-0"]
    shared.wait_event("term", "CreatedPods", "term-rollout-1")


def test_a_missing_gang_scheduler_crd_fails_the_job_and_says_what_to_install(
    shared: Cluster,
) -> None:
    """Without Volcano's CRDs the PodGroup create gets a plain 404: no retry can help, so the
    job fails at once with an Event naming what to install (it used to retry forever with an
    empty phase)."""
    remove_podgroup_crd(shared.kube.cp, "scheduling.volcano.sh")
    shared.create(quickstart("nogang", scheduling={"gang": "volcano"}))
    status = shared.wait_phase("nogang", "Failed")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "GangSchedulerMissing"
    assert "scheduling.volcano.sh/v1beta1" in failed["message"]
    assert "install Volcano" in failed["message"]
    event = shared.wait_event("nogang", "GangSchedulerMissing", "install Volcano")
    assert event[0] == "Warning"
    assert shared.pods("nogang") == {}


def test_every_phase_change_is_an_event_kubectl_describe_shows(shared: Cluster) -> None:
    _start(shared, "story")
    shared.kube.set_pod_phase(shared.namespace, "story-trainer-0", "Succeeded")
    shared.wait_phase("story", "Succeeded")
    for phase in ("Pending", "Running", "Succeeded"):
        shared.wait_event("story", phase)
    described = shared.kube.kubectl("describe", "lrj", "story")
    assert described.returncode == 0, described.stderr
    events = described.stdout.split("Events:", 1)[1]
    for reason in ("Pending", "Running", "Succeeded", "CreatedPods"):
        assert re.search(rf"^\s+\S+\s+{reason}\s", events, re.M), (reason, events)
