"""One fault of the matrix, injected N times at seeded random steps into one tiny job on the
real control plane with the process kubelet, and the figures issue #17 asks for (bench/chaos.py
writes them for every fault; tests/e2e/test_cluster_chaos.py runs a short mix).

Each injection waits for the fleet to be whole again (every expected pod running once with all
its containers, every rollout sidecar in sync, a new step recorded) before the next one, so
`seconds_to_recover` is fault -> all of that; `seconds_to_next_step` is fault -> the first step
recorded after it that is past every step recorded before it.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.chaos import faults
from harness.chaos.figures import combine, summary
from harness.cluster.cluster import Cluster
from harness.cluster.jobs import JOB_LABEL, cluster_job, job_pods, trainer_log

Obj = dict[str, Any]


@dataclass
class Fault:
    name: str
    what: str
    inject: Callable[[Cluster, str, random.Random, int], str] | None  # None: scale's own
    # Steps from one injection to the next (the recovery and the 1-4 steps after it), to size
    # totalSteps: session 9's measured spans plus ~10% (the 2026-11-24 matrix measured shorter
    # ones for sidecar_kill, ~29 steps, and operator_kill, ~46: their jobs ran ~200-step tails).
    steps_per_injection: int
    job: dict[str, Any] = field(default_factory=dict)  # cluster_job keyword overrides
    replicas: int = 2  # rollout replicas of the job
    reward_pod: bool = False


def _engine_kill(c: Cluster, name: str, rng: random.Random, i: int) -> str:
    return faults.kill_container(c, f"{name}-rollout-{rng.randrange(2)}", "engine")


def _sidecar_kill(c: Cluster, name: str, rng: random.Random, i: int) -> str:
    return faults.kill_container(c, f"{name}-rollout-{rng.randrange(2)}", "sidecar")


def _rollout_delete(c: Cluster, name: str, rng: random.Random, i: int) -> str:
    return faults.delete_pod(c, f"{name}-rollout-{rng.randrange(2)}", preempt=i % 2 == 1)


def _trainer_kill(c: Cluster, name: str, rng: random.Random, i: int) -> str:
    return faults.kill_trainer_rank(c, name, rng.randrange(2))


def _operator_kill(c: Cluster, name: str, rng: random.Random, i: int) -> str:
    """Mid-reconcile: a rollout pod is deleted and the operator's pod dies 0-0.5 s later, while
    it recreates it: its container SIGKILLed (restarted by the kubelet), or every other time
    the pod deleted with grace 0 (replaced by its ReplicaSet)."""
    deleted = faults.delete_pod(c, f"{name}-rollout-{rng.randrange(2)}")
    time.sleep(rng.uniform(0, 0.5))
    killed = faults.kill_operator(c, replace=i % 2 == 1)
    faults.wait_operator(c)
    return f"{deleted}; {killed}; ready again"


def _control_plane_restart(component: str) -> Any:
    def inject(c: Cluster, name: str, rng: random.Random, i: int) -> str:
        return faults.restart_control_plane(c, component)

    return inject


def _reward_kill(c: Cluster, name: str, rng: random.Random, i: int) -> str:
    return faults.kill_container(c, f"{name}-reward-0", "reward")


_DELETE = "kubectl delete a rollout pod; every other one preempted (SIGKILL, grace-0 delete)"
_OPERATOR = (
    "kill the operator's pod 0-0.5 s after a rollout pod is deleted (SIGKILL, or every "
    "other time deleted with grace 0)"
)
FAULTS = {
    f.name: f
    for f in (
        Fault("engine_kill", "SIGKILL a rollout pod's engine (its main process)", _engine_kill, 30),
        Fault("rollout_delete", _DELETE, _rollout_delete, 45),
        Fault("sidecar_kill", "SIGKILL a rollout pod's sync sidecar", _sidecar_kill, 42),
        Fault("trainer_rank_kill", "SIGKILL one torchrun worker", _trainer_kill, 6),
        Fault("operator_kill", _OPERATOR, _operator_kill, 55),
        Fault("scale", "kubectl scale lrj --replicas=3, then 1, then back to 2", None, 105),
        Fault("reward_kill", "SIGKILL the reward pod's process", _reward_kill, 5, {}, 1, True),
        Fault(
            "apiserver_restart",
            "restart kube-apiserver (SIGTERM, start again)",
            _control_plane_restart("kube-apiserver"),
            30,
        ),
        Fault(
            "etcd_restart",
            "restart etcd (SIGTERM, start again)",
            _control_plane_restart("etcd"),
            30,
        ),
    )
}


@dataclass
class Injection:
    index: int
    step: int  # last step recorded before it
    at: float  # wall time
    detail: str
    recovered: bool = False
    seconds_to_recover: float | None = None
    seconds_to_next_step: float | None = None
    steps_lost: int = 0
    reward_before: float | None = None
    reward_after: float | None = None
    note: str = ""
    scale_up_lag_steps: int | None = None  # scale: first step with requests - step_in_progress()
    # when its sidecar was seen in sync
    scale_down_next_step_s: float | None = None  # scale: 3 -> 1 -> the next new step


def job_for(fault: Fault, name: str, steps: int, checkpoint_interval: int) -> Obj:
    job = cluster_job(name, training__totalSteps=steps,
                      training__checkpointInterval=checkpoint_interval)  # fmt: skip
    job["spec"]["runPolicy"] = {"backoffLimit": 100}  # every trainer kill is one restart
    # The quickstart's lr is for 30 steps. Held for 600, a fault-free run's reward sat at ~1.0
    # from step ~80 while its KL to the start swung between 0.3 and 5 nats (steps 250-560): the
    # update then feeds on the KL term alone and overshoots, and one such swing in a fault job
    # read as "the reward fell across a fault". Decaying the lr keeps the long jobs steady.
    job["spec"]["optim"]["scheduler"] = "cosine"
    job["spec"]["rollout"]["replicas"] = fault.replicas
    if fault.reward_pod:
        job["spec"]["rollout"]["syncMode"] = "adapter"
        # Default retries: when they run out the trainer waits for the pod to come back.
        job["spec"]["reward"]["service"] = {"replicas": 1}
    return job


def expected_pods(fault: Fault, replicas: int | None = None) -> dict[str, int]:
    out = {"trainer": 1, "rollout": fault.replicas if replicas is None else replicas}
    return out | ({"reward": 1} if fault.reward_pod else {})


def wait_recovered(
    c: Cluster, name: str, w: faults.Watcher, inj: Injection, want: dict[str, int], timeout: float
) -> None:
    """Until the fleet is whole and a step past `inj.step` is recorded (or the job ends)."""
    deadline = time.monotonic() + timeout
    why = ""
    while time.monotonic() < deadline:
        c.kubelet.raise_errors()
        _next_step_time(w, inj)
        phase = ((c.job(name) or {}).get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            inj.note = f"job {phase} before recovery ({why})"
            return
        why = faults.fleet_healthy(c, name, want) or ""
        if not why and _next_step_time(w, inj):
            inj.recovered = True
            inj.seconds_to_recover = round(time.time() - inj.at, 1)
            return
        time.sleep(0.5)
    inj.note = f"not recovered in {timeout:.0f} s: {why}"


def _next_step_time(w: faults.Watcher, inj: Injection) -> bool:
    """Whether a step past `inj.step` is recorded; notes when the first one was."""
    if w.step() <= inj.step:
        return False
    if inj.seconds_to_next_step is None:
        first = min(t for s, t in w.first_times().items() if s > inj.step)
        inj.seconds_to_next_step = round(first - inj.at, 1)
    return True


def scale_injection(c: Cluster, name: str, w: faults.Watcher, inj: Injection, fault: Fault,
                    timeout: float) -> None:  # fmt: skip
    """2 -> 3: the third engine must serve generation within one step of its sidecar being in
    sync (step history `engineRequests`); then 3 -> 1 and back to 2, each waited for."""
    in_sync_at = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and in_sync_at is None:
        status = faults.sidecar_status(c, f"{name}-rollout-2")
        if status and status.get("inSync"):
            in_sync_at = time.time()
        time.sleep(0.3)
    wait_recovered(c, name, w, inj, expected_pods(fault, 3), timeout)
    if not inj.recovered:
        return
    # The steps right after it joined, before scaling down, to see whom they asked.
    if not _wait_step(c, name, w, w.step() + 3, timeout):
        inj.recovered, inj.note = False, "no steps after the third engine joined"
        return
    # This cycle's rollout-2 only: an earlier cycle's pod had the same name.
    served = [s for s in engine_served_steps(w, "rollout-2") if s > inj.step]
    if not served:
        inj.recovered, inj.note = False, "the third engine served no step after joining"
        return
    in_sync_step = step_in_progress(w, in_sync_at) if in_sync_at is not None else None
    if in_sync_step is not None:
        inj.scale_up_lag_steps = served[0] - in_sync_step
    for replicas in (1, 2):
        inj.detail += f"; {faults.scale(c, name, replicas)}"
        step = w.step()
        part = Injection(inj.index, step, time.time(), "")
        wait_recovered(c, name, w, part, expected_pods(fault, replicas), timeout)
        if replicas == 1:
            inj.scale_down_next_step_s = part.seconds_to_next_step
        if not part.recovered:
            inj.recovered, inj.note = False, f"--replicas={replicas}: {part.note}"
            return


def step_in_progress(w: faults.Watcher, t: float) -> int | None:
    """The step the trainer was running at wall time `t`: the first one recorded (again) after
    it. Row times are the trainer's own clock, so this does not depend on how late the history
    was polled (the step count the harness had read at `t` could be a step behind)."""
    after = [s for s, times in w.records.items() if max(times) >= t]
    return min(after) if after else None


def engine_served_steps(w: faults.Watcher, replica: str) -> list[int]:
    """Steps whose `engineRequests` sent `replica` at least one generation request."""
    return [s for s, times in sorted(w.records.items())
            if (times[max(times)].get("engineRequests") or {}).get(replica)]  # fmt: skip


def run_fault(c: Cluster, fault: Fault, injections: int, *, seed: int = 17, name: str | None = None,
              checkpoint_interval: int = 3, recover_timeout: float = 400,
              history_dir: Path | None = None) -> Obj:  # fmt: skip
    """Inject `injections` times into one job of the fault, or into several one after the other
    when a job ends before all of them were made (its totalSteps is an estimate of how many
    steps the recoveries span); the figures of all of them together."""
    name = name or f"chaos-{fault.name.replace('_', '-')}"
    rng = random.Random(f"{seed}-{fault.name}")
    runs: list[Obj] = []
    made = 0
    while made < injections and len(runs) < MAX_JOB_RUNS:
        run = _run_job(c, fault, f"{name}-r{len(runs) + 1}" if runs else name, injections - made,
                       rng, checkpoint_interval, recover_timeout, history_dir)  # fmt: skip
        runs.append(run)
        made += run["runs"]
        if run["runs"] == 0 or run["succeeded"] != run["runs"]:
            break  # a job that failed or did not recover: report it, do not paper over it
    result = combine(runs)
    result["injections_requested"] = injections
    return result


MAX_JOB_RUNS = 4
MAX_JOB_STEPS = 1200  # longer fault runs take several jobs


def _run_job(c: Cluster, fault: Fault, name: str, injections: int, rng: random.Random,
             checkpoint_interval: int, recover_timeout: float,
             history_dir: Path | None = None) -> Obj:  # fmt: skip
    """Apply one job of the fault, inject up to `injections` times, follow it to its end."""
    first_at = rng.randint(3, 6)
    steps = job_steps(fault, injections, first_at)
    job = job_for(fault, name, steps, checkpoint_interval)
    applied = time.monotonic()
    c.apply(yaml.safe_dump(job))
    done: list[Injection] = []
    with faults.Watcher(c, name) as w:
        next_step, recovery_steps = first_at, 0
        for i in range(injections):
            if not _wait_step(c, name, w, next_step, timeout=600):
                break
            w.poll_history()
            if steps - w.step() < room_needed(fault, recovery_steps):
                break  # too close to the job's end to see a recovery: the next job goes on
            inj = Injection(i, w.step(), time.time(), "")
            if fault.name == "scale":
                inj.detail = faults.scale(c, name, 3)
                scale_injection(c, name, w, inj, fault, recover_timeout)
            else:
                assert fault.inject is not None
                inj.detail = fault.inject(c, name, rng, i)
                wait_recovered(c, name, w, inj, expected_pods(fault), recover_timeout)
            done.append(inj)
            if not inj.recovered:
                break
            recovery_steps = max(recovery_steps, w.step() - inj.step)
            next_step = w.step() + rng.randint(1, 4)
        latest = _final_engines_check(c, name, w, steps)
        phase = _wait_end(c, name, timeout=max(300, 6 * (steps - w.step())))
    _per_injection(done, w)
    if history_dir is not None:
        _keep_history(history_dir / name, c, w, done)
    status = (c.job(name) or {}).get("status") or {}
    result = summary(fault, done, phase, w, status, latest, faults.checkpoints_bad(c, name))
    result["seconds"] = round(time.monotonic() - applied, 1)
    result["total_steps"] = steps
    if phase != "Succeeded":
        result["trainer_log_tail"] = trainer_log(c, name)[-1500:]
    c.kubectl("delete", "lrj", name, "--wait=false")
    c.kubelet.wait(lambda: not job_pods(c, name), 120, f"{name}'s pods collected")
    return result


FINAL_READ_STEPS = 5  # steps left after the last recovery to read every engine's version


def job_steps(fault: Fault, injections: int, first_at: int) -> int:
    """totalSteps for a job of `injections`: each spans steps_per_injection (fault to recovered
    to the next fault), the last one also needs room_needed() after it. Every step past the last
    recovery is waited for, so this is tight; one that runs over goes on in the next job."""
    steps = first_at + injections * fault.steps_per_injection + room_needed(fault, 0)
    return min(steps, MAX_JOB_STEPS)


def room_needed(fault: Fault, recovery_steps: int) -> int:
    """Steps a job must have left for one more injection: 1.5x the longest recovery seen in it
    so far (the first: the fault's estimate), and the final read."""
    return max(fault.steps_per_injection, round(1.5 * recovery_steps)) + FINAL_READ_STEPS


def _wait_step(c: Cluster, name: str, w: faults.Watcher, step: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c.kubelet.raise_errors()
        w.poll_history()
        if w.step() >= step:
            return True
        if ((c.job(name) or {}).get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return False
        time.sleep(0.3)
    return False


def _final_engines_check(c: Cluster, name: str, w: faults.Watcher, steps: int) -> str:
    """Every running engine on the trainer's newest version, read while the job still runs."""
    deadline = time.monotonic() + 120
    detail = "the job ended before a consistent read"
    while time.monotonic() < deadline and w.step() < steps:
        ok, detail = faults.engines_on_latest(c, name)
        if ok:
            return "ok: " + detail
        time.sleep(0.5)
    return "NO: " + detail


def _wait_end(c: Cluster, name: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c.kubelet.raise_errors()
        phase = ((c.job(name) or {}).get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            return phase
        time.sleep(1)
    return f"not finished in {timeout:.0f} s"


def _keep_history(out: Path, c: Cluster, w: faults.Watcher, done: list[Injection]) -> None:
    """The job's rows and injections, and the logs of its pods still on the node."""
    rows = [row for times in w.records.values() for row in times.values()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "history.json").write_text(json.dumps({"injections": [asdict(i) for i in done],
                                "history": sorted(rows, key=lambda r: r["time"])}))  # fmt: skip
    for run in list(c.kubelet.pods.values()):
        if (run.pod["metadata"].get("labels") or {}).get(JOB_LABEL) == out.name:
            for ctr in run.containers:  # one log per restart; the folder also holds rootfs
                dest = out / "logs" / run.key / ctr.name
                dest.mkdir(parents=True, exist_ok=True)
                for log in ctr.log_path.parent.glob("*.log"):
                    with contextlib.suppress(OSError):  # a pod being collected meanwhile
                        shutil.copy2(log, dest / log.name)


def _per_injection(done: list[Injection], w: faults.Watcher) -> None:
    rewards = w.rewards()
    for k, inj in enumerate(done):
        until = done[k + 1].at if k + 1 < len(done) else float("inf")
        inj.steps_lost = sum(1 for times in w.records.values()
                             if min(times) < inj.at and any(inj.at < t < until for t in times)
                             and len(times) > 1)  # fmt: skip
        before = [r for s, t, r in rewards if t < inj.at][-5:]
        after = [r for s, t, r in rewards if t > inj.at + (inj.seconds_to_recover or 0)][:5]
        if before and after:
            inj.reward_before = round(statistics.mean(before), 3)
            inj.reward_after = round(statistics.mean(after), 3)
