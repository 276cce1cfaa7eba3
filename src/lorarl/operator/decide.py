"""Pure: observed state -> what to do. One level-triggered pass for every trigger (create, pod
event, timer, scale, suspend), so handlers never disagree and a re-run is always safe.

Trainer pods carry an `attempt` label (the restart count when they were created): a failure of
a pod from an older attempt is history, not a new restart, so a restart is never counted twice.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lorarl.api.reports.progress import Progress
from lorarl.api.reports.status import LoRARLJobStatus, ModelStatus, Phase
from lorarl.api.resource import LoRARLJob
from lorarl.operator.builders import rollout_selector
from lorarl.operator.status import (
    PodView,
    apply_progress,
    final_progress,
    is_true,
    phase_of,
    reason_word,
    set_condition,
)

TERMINAL = ("Succeeded", "Failed")
FINISHED_POD = ("Succeeded", "Failed")
RECREATED_ALONE = ("rollout", "reward")  # a dead one is replaced; the trainer keeps going
# Pod status reasons of a pod its node ended rather than its own process: spot/preemptible
# capacity reclaimed (a graceful node shutdown leaves Terminated, older kubelets Shutdown; a pod
# refused by a node shutting down NodeShutdown), kubelet and API evictions (Evicted), kubelet
# preemption for a critical pod (Preempting), an unreachable node (NodeLost).
PREEMPTED_REASONS = frozenset(
    ("Preempted", "Preempting", "Shutdown", "Terminated", "NodeShutdown", "NodeLost", "Evicted")
)


@dataclass(frozen=True)
class Observed:
    job: LoRARLJob
    generation: int
    status: LoRARLJobStatus
    replicas: Mapping[str, int]  # role -> desired pods (from the plan)
    pods: Sequence[PodView]
    now: dt.datetime
    progress: Progress | None = None
    # Pods that vanished since the last pass without the operator deleting them (a node that
    # went away, a spot preemption, `kubectl delete`): the pod watch's DELETED events.
    lost: Sequence[PodView] = ()


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Decision:
    status: LoRARLJobStatus
    delete: list[str] = field(default_factory=list)  # pod names, deleted before creating
    create: list[tuple[str, int]] = field(default_factory=list)  # (role, index)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False
    restarted: bool = False

    @property
    def attempt(self) -> int:
        """The attempt label for trainer pods created by this decision."""
        return self.status.restarts


def rfc3339(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    try:
        return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return None


class _Pass:
    def __init__(self, obs: Observed) -> None:
        self.obs = obs
        self.now = rfc3339(obs.now)
        # A finished job keeps what it finished with: the last poll's cached report is older
        # than the trainer's final one (its termination message) and must not overwrite it.
        progress = None if obs.status.phase in TERMINAL else obs.progress
        self.d = Decision(status=apply_progress(obs.status.model_copy(deep=True), progress))
        self.live = [p for p in obs.pods if not p.deleting]

    @property
    def st(self) -> LoRARLJobStatus:
        return self.d.status

    def cond(self, type_: str, ok: bool, reason: str, message: str) -> None:
        self.st.conditions = set_condition(
            self.st.conditions, type_, ok, reason, message, self.now, self.obs.generation
        )

    def event(self, type_: str, reason: str, message: str) -> None:
        self.d.events.append(Event(type_, reason, message))

    def delete(self, pods: Sequence[PodView]) -> None:
        for p in pods:
            if p.name not in self.d.delete:
                self.d.delete.append(p.name)

    def kept(self) -> list[PodView]:
        return [p for p in self.live if p.name not in self.d.delete]

    def set_phase(self, phase: Phase, message: str, warning: bool = False) -> None:
        if self.st.phase != phase:
            self.event("Warning" if warning else "Normal", phase, message)
        self.st.phase = phase

    def count_rollouts(self, extra: int = 0) -> None:
        self.st.rollout_replicas = extra + sum(p.role == "rollout" for p in self.kept())

    def cleanup(self, *, stop_running: bool = False) -> None:
        """Pods of a finished job, per runPolicy.cleanPodPolicy."""
        policy = self.obs.job.spec.run_policy.clean_pod_policy
        if policy == "All":
            self.delete(self.live)
        elif policy == "Running" or stop_running:
            self.delete([p for p in self.live if p.phase not in FINISHED_POD])

    def active_seconds(self) -> float:
        """Time admitted and not suspended: the closed stretches plus the open one."""
        since = parse_time(self.st.active_since)
        open_stretch = (self.obs.now - since).total_seconds() if since else 0.0
        return self.st.active_seconds + max(open_stretch, 0.0)

    def clock(self, running: bool) -> None:
        """Start or stop the deadline clock; a stopped clock keeps what it counted."""
        if running and self.st.active_since is None:
            self.st.active_since = self.now
            self.st.start_time = self.st.start_time or self.now
        elif not running and self.st.active_since is not None:
            self.st.active_seconds = int(self.active_seconds())
            self.st.active_since = None

    def finish(
        self, phase: Phase, reason: str, message: str, *, stop_running: bool = False
    ) -> None:
        self.clock(False)
        self.st.completion_time = self.st.completion_time or self.now
        self.cond(phase, True, reason, message)
        self.cond("Running", False, phase, message)
        self.set_phase(phase, message, warning=phase == "Failed")
        self.cleanup(stop_running=stop_running)
        self.count_rollouts()


def decide(obs: Observed) -> Decision:
    p = _Pass(obs)
    spec, name, st = obs.job.spec, obs.job.name, p.st
    st.observed_generation = obs.generation
    st.rollout_selector = rollout_selector(name)
    if st.total_steps is None:
        st.total_steps = spec.training.steps  # None with epochs: the trainer reports it

    if st.phase in TERMINAL:
        p.cleanup(stop_running=is_true(st, "Failed"))
        p.count_rollouts()
        ttl = spec.run_policy.ttl_seconds_after_finished
        done = parse_time(st.completion_time)
        if ttl is not None and done is not None and obs.now >= done + dt.timedelta(seconds=ttl):
            p.d.delete_job = True
            p.event("Normal", "TTLExpired", f"deleting the job {ttl}s after it finished")
        return p.d

    if not is_true(st, "Created"):
        p.cond(
            "Created",
            True,
            "ChildrenCreated",
            "service, config, engine key, network policy and pods created",
        )

    if spec.run_policy.suspend:
        p.clock(False)
        p.delete(p.live)
        message = "spec.runPolicy.suspend is true: pods deleted, checkpoints kept"
        p.cond("Suspended", True, "Suspended", message)
        p.cond("Running", False, "Suspended", message)
        p.cond("TrainerReady", False, "Suspended", message)
        p.cond("RolloutReady", False, "Suspended", message)
        p.set_phase("Suspended", message)
        st.rollout_replicas = 0
        return p.d

    if st.phase == "Suspended":
        # Intent, not a claim: a suspended pod still terminating keeps its name (409 on create)
        # and is created again on a later pass; the CreatedPods Event says when it is.
        p.cond(
            "Suspended",
            False,
            "Resumed",
            "spec.runPolicy.suspend is false: the pods are created again once the old ones "
            "have terminated",
        )
        p.event(
            "Normal",
            "Resumed",
            "creating the pods again; the trainer resumes from its checkpoint",
        )

    # The deadline counts only time admitted and not suspended: queued time is not running time.
    p.clock(_admitted(obs, p.live))
    deadline = spec.run_policy.active_deadline_seconds
    if deadline and p.active_seconds() >= deadline:
        p.finish(
            "Failed",
            "DeadlineExceeded",
            f"the job ran longer than activeDeadlineSeconds ({deadline}s)",
            stop_running=True,
        )
        return p.d

    if spec.model.from_hub and _pin_model(p):
        return p.d

    restarting = st.phase == "Restarting"
    trainers = [x for x in p.live if x.role == "trainer"]
    p.delete([x for x in trainers if x.attempt < st.restarts])  # left over from a restart
    current = [x for x in trainers if x.attempt >= st.restarts]
    rank0 = next((x for x in current if x.index == 0), None)
    if rank0 is not None and rank0.phase == "Succeeded":
        p.d.status = apply_progress(p.st, final_progress(rank0.message))
        p.cond("Succeeded", True, "TrainerSucceeded", f"trainer pod {rank0.name} completed")
        p.finish("Succeeded", "TrainerSucceeded", f"trainer pod {rank0.name} completed")
        return p.d

    failed = sorted((x for x in current if x.phase == "Failed"), key=lambda x: x.index)
    if failed:
        bad = failed[0]
        detail = _failure_detail(bad)
        limit = spec.run_policy.backoff_limit
        if st.restarts >= limit:
            p.finish(
                "Failed",
                reason_word(bad.reason, "TrainerFailed"),
                f"{detail}; backoffLimit ({limit}) reached after {st.restarts} restarts",
            )
            return p.d
        st.restarts += 1
        p.d.restarted = restarting = True
        p.delete(current)
        current = []
        p.event(
            "Warning",
            "TrainerRestart",
            f"{detail}; restarting the trainer group from its "
            f"last checkpoint (restart {st.restarts} of backoffLimit {limit})",
        )

    for x in p.live:
        if x.role not in RECREATED_ALONE:
            continue
        if x.index >= obs.replicas.get(x.role, 0):
            p.delete([x])  # scaled down
        elif x.phase in FINISHED_POD:
            p.delete([x])
            if x.role == "rollout" and preempted(x):
                st.rollout_preemptions += 1
                p.event(
                    "Normal",
                    "RolloutPreempted",
                    f"rollout pod {x.name} was preempted ({_preemption(x)}); recreating it "
                    "alone, the trainer keeps going",
                )
                continue
            st.rollout_restarts += x.role == "rollout"
            p.event(
                "Warning",
                "RolloutRestart",
                f"{_failure_detail(x, 'ended')}; recreating it alone, the trainer keeps going",
            )
    # Never counted against backoffLimit: that budget is the trainer group's.
    for x in obs.lost:
        if x.role == "rollout" and x.index < obs.replicas.get("rollout", 0):
            st.rollout_preemptions += 1
            why = _preemption(x)
            how = f"its node took it away ({why})" if why else "it was deleted, not by lorarl"
            p.event(
                "Normal",
                "RolloutPreempted",
                f"rollout pod {x.name} is gone: {how}; recreating it alone, the trainer keeps "
                "going",
            )

    occupied = {x.name for x in obs.pods if x.name not in p.d.delete}
    by_role: dict[str, list[PodView]] = {}
    for x in p.kept():
        by_role.setdefault(x.role, []).append(x)
    for role, count in obs.replicas.items():
        have = {x.index for x in by_role.get(role, [])}
        for i in range(count):
            if i not in have and f"{name}-{role}-{i}" not in occupied:
                p.d.create.append((role, i))

    kept = p.kept()
    n_trainer = obs.replicas.get("trainer", 0)
    trainer_running = sum(x.running for x in kept if x.role == "trainer")
    others = {r: c for r, c in obs.replicas.items() if r != "trainer"}
    other_running = {
        r: sum(x.running and x.index < c for x in kept if x.role == r) for r, c in others.items()
    }
    trainer_ready = trainer_running == n_trainer
    rollout_ready = all(other_running[r] == c for r, c in others.items())
    p.cond(
        "TrainerReady",
        trainer_ready,
        "AllRunning" if trainer_ready else "NotRunning",
        f"{trainer_running}/{n_trainer} trainer pods running",
    )
    n_rollout = others.get("rollout", 0)
    p.cond(
        "RolloutReady",
        rollout_ready,
        "AllRunning" if rollout_ready else "NotRunning",
        f"{other_running.get('rollout', 0)}/{n_rollout} rollout pods running",
    )
    phase = phase_of(
        trainer_ready=trainer_ready,
        rollout_ready=rollout_ready,
        any_running=any(x.running for x in kept),
        restarting=restarting,
    )
    total = n_trainer + sum(others.values())
    messages = {
        "Running": f"all {total} pods running",
        "Starting": f"{sum(x.running for x in kept)}/{total} pods running",
        "Pending": f"waiting for {total} pods to start",
        "Restarting": f"restarting the trainer group (restart {st.restarts})",
    }
    p.cond(
        "Running",
        phase == "Running",
        "AllPodsRunning" if phase == "Running" else phase,
        messages[phase],
    )
    p.set_phase(phase, messages[phase])
    p.count_rollouts(extra=sum(r == "rollout" for r, _ in p.d.create))
    return p.d


def _pin_model(p: _Pass) -> bool:
    """status.model.revision: the first commit a pod's fetch-model reports. Later pods fetch
    that commit (the reconciler pins their command); a pod that loaded another one (the hub's
    branch moved while pods with their own caches started) would train or serve other weights,
    so the job fails and says how to avoid it. True: the job has finished."""
    model, st = p.obs.job.spec.model, p.st
    for x in p.live:
        if not x.model_revision:
            continue
        if st.model is None:
            st.model = ModelStatus(source=model.path, revision=x.model_revision)
            p.event(
                "Normal",
                "ModelFetched",
                f"{model.path} at commit {x.model_revision} (pod {x.name}): every pod of the "
                "job loads this commit",
            )
        elif x.model_revision != st.model.revision:
            p.finish(
                "Failed",
                "ModelRevisionMismatch",
                f"pod {x.name} fetched {model.path} at commit {x.model_revision[:12]}, the "
                f"job's other pods {st.model.revision[:12]}: {model.revision or 'main'} moved "
                "on the hub while the pods started; set spec.model.revision to a commit, or "
                "spec.model.volume so the pods share one cache",
                stop_running=True,
            )
            return True
    return False


def preempted(pod: PodView) -> bool:
    """Whether a finished pod was ended by its node (spot reclaim, shutdown, eviction) rather
    than by its own containers failing."""
    return bool(pod.disruption) or bool({pod.pod_reason, pod.reason} & PREEMPTED_REASONS)


def _preemption(pod: PodView) -> str:
    """Why the node ended it, in Kubernetes' words ("" when nothing says)."""
    named = [r for r in (pod.pod_reason, pod.reason) if r in PREEMPTED_REASONS]
    return ", ".join(dict.fromkeys([*([pod.disruption] if pod.disruption else []), *named]))


def _admitted(obs: Observed, live: Sequence[PodView]) -> bool:
    """Whether the job may run now. Kueue admits a queued job by lifting its pods' scheduling
    gates, so a queued job (pods not created yet, or all gated) is not admitted; a job without
    a queue is admitted as soon as it is not suspended."""
    if live:
        return not all(x.gated for x in live)
    return obs.job.spec.scheduling.queue_name is None


def _failure_detail(pod: PodView, verb: str = "failed") -> str:
    parts = [f"{pod.role} pod {pod.name} {verb}"]
    if pod.reason or pod.exit_code is not None:
        bits = [
            b
            for b in (pod.reason, f"exit code {pod.exit_code}" if pod.exit_code is not None else "")
            if b
        ]
        parts.append(f" ({', '.join(bits)})")
    if pod.message:
        parts.append(f": {pod.message}")
    return "".join(parts)
