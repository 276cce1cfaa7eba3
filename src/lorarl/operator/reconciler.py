"""The I/O side of a reconcile pass: read what is there, ask `decide`, do it, write status.

One `JobState` per job holds a lock (passes for one job never interleave, whatever triggered
them), the status this operator last wrote (the watch may lag behind our own writes), the
trainer's last progress report, and whether the job's fixed children were ensured in this
process. A crash loses only this cache: the next pass rebuilds it from the API.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import kopf
from pydantic import ValidationError

from lorarl.api.reports.progress import Progress
from lorarl.api.reports.status import LoRARLJobStatus
from lorarl.api.resource import LoRARLJob
from lorarl.api.validation import ManifestError
from lorarl.bounded_fetch import MAX_PROGRESS_BYTES, FetchError
from lorarl.operator import builders, progress_fetch
from lorarl.operator.config import OperatorConfig
from lorarl.operator.decide import TERMINAL, Decision, Observed, decide, rfc3339
from lorarl.operator.kube import Kube, KubeError, job_path, path
from lorarl.operator.metrics import OperatorMetrics
from lorarl.operator.parsing import Parsed, parsed, plain
from lorarl.operator.status import PodView, pod_view, set_condition
from lorarl.plan import JobPlan

log = logging.getLogger("lorarl.operator")
Key = tuple[str, str]
LAG = 30.0  # seconds after which the pod index is trusted over our own memory
# How long a pod this operator deleted is remembered as its own: its DELETED event (after a
# grace period of up to terminationGracePeriodSeconds) must not read as a preemption.
OWN_DELETES = 600.0
# A burst of pod events for one job (three pods created, then scheduled, then running) becomes
# one pass: the first event waits this long, later ones join it.
DEBOUNCE = 0.2
POLLS = 16  # progress requests in flight at once
# Between two trainer steps the report does not change; a tick skips its poll until the next
# step is due, but never more than this many ticks in a row (a step faster than the last one,
# e.g. after a slow first step, is seen at most this much later).
MAX_SKIPPED_POLLS = 2
PERMANENT_STATUSES = (400, 422)  # BadRequest, Invalid: the same request can never succeed


@dataclass
class JobState:
    uid: str
    body: dict[str, Any]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    status: LoRARLJobStatus | None = None
    progress: Progress | None = None
    ensured: bool = False
    config_hash: str | None = None
    phase: str | None = None
    # Our own pod writes the pod index has not shown yet: name -> (view, when); uid -> when.
    created: dict[str, tuple[PodView, float]] = field(default_factory=dict)
    deleted: dict[str, float] = field(default_factory=dict)
    parsed: Parsed | None = None  # the spec's parse, plan and config, reused while it is unchanged
    parsed_version: tuple[Any, ...] | None = None  # `_spec_version` of the body `parsed` read
    progress_raw: bytes | None = None  # the body `progress` was parsed from
    changed_at: float | None = None  # monotonic time the report last changed
    skipped: int = 0  # polls skipped in a row (`_poll_due`)
    # Pod events not yet reconciled: the newest pod list, and whether a pass is already waiting.
    pending: list[PodView] | None = None
    poking: bool = False
    # Pods this operator deleted (uid -> when), and rollout pods that vanished without it (uid
    # -> last view): the next pass recreates and counts those (status.rolloutPreemptions).
    own_deletes: dict[str, float] = field(default_factory=dict)
    lost: dict[str, PodView] = field(default_factory=dict)
    # Pods told that Kueue will not retry their group (uid), once the job finished.
    released: set[str] = field(default_factory=set)

    def pod_gone(self, view: PodView, now: float) -> None:
        """A pod of the job was deleted: remember it as lost unless this operator deleted it
        (or it was counted already: a watch may repeat a DELETED event)."""
        self.own_deletes = {u: t for u, t in self.own_deletes.items() if now - t < OWN_DELETES}
        if view.uid and view.uid not in self.own_deletes:
            self.lost[view.uid] = view

    def observe(self, pods: list[PodView], now: float) -> list[PodView]:
        """The index, corrected for writes it has not caught up with: a pass right after a
        create must not create again, nor count a pod it just deleted."""
        uids = {p.uid for p in pods}
        self.deleted = {u: t for u, t in self.deleted.items() if u in uids and now - t < LAG}
        out = [p for p in pods if p.uid not in self.deleted]
        names = {p.name for p in out}
        self.created = {
            n: (v, t) for n, (v, t) in self.created.items() if n not in names and now - t < LAG
        }
        return out + [v for v, _ in self.created.values()]


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        config: OperatorConfig,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self.kube, self.config, self.metrics = kube, config, metrics
        self.jobs: dict[Key, JobState] = {}
        self.debounce = DEBOUNCE
        self.closed = False  # at shutdown, handlers still in flight must not touch the clients
        self._progress: aiohttp.ClientSession | None = None  # made in the loop, at first poll
        # At most POLLS in flight: the timers of jobs created together fire together (1,000
        # polls at once at scale), and a deadline must time the answer, not the queue.
        self._polls = asyncio.Semaphore(POLLS)

    async def close(self) -> None:
        self.closed = True
        if self._progress is not None:
            await self._progress.close()

    def phases(self) -> dict[Key, str | None]:
        return {k: s.phase for k, s in self.jobs.items()}

    def remember(self, body: Mapping[str, Any]) -> JobState:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace") or "default", meta["name"])
        state = self.jobs.get(key)
        if state is None or state.uid != meta.get("uid"):  # new, or deleted and re-created
            state = self.jobs[key] = JobState(uid=meta.get("uid", ""), body=plain(body))
        elif not _same_version(state.body, meta):  # a timer tick mostly sees the body it kept
            state.body = plain(body)
        if state.phase is None:
            state.phase = (body.get("status") or {}).get("phase")
        return state

    def pod_gone(self, namespace: str, name: str, view: PodView) -> None:
        """The pod watch saw one of the job's pods deleted (see `JobState.pod_gone`)."""
        state = self.jobs.get((namespace, name))
        if state is not None:
            state.pod_gone(view, time.monotonic())

    def forget(self, namespace: str, name: str) -> None:
        self.jobs.pop((namespace, name), None)

    async def poke(self, namespace: str, name: str, pods: Iterable[PodView], trigger: str) -> None:
        """A pod of the job changed: reconcile with the newest body this process has seen.

        Debounced per job: while one poke waits for its pass, later ones only hand it their
        (newer) pod list, so a burst of events costs one pass, not one each."""
        state = self.jobs.get((namespace, name))
        if state is None:
            return
        state.pending = list(pods)
        if state.poking:
            return  # the waiting pass will see these pods
        state.poking = True
        taken = False

        def take() -> list[PodView]:  # at the start of the pass: later events start a new one
            nonlocal taken
            state.poking, taken = False, True
            pods, state.pending = state.pending or [], None
            return pods

        try:
            await asyncio.sleep(self.debounce)
            await self._locked(state, take, trigger, False)
        finally:
            if not taken:  # cancelled or closed before the pass began
                state.poking = False

    async def reconcile(
        self, body: Mapping[str, Any], pods: Iterable[PodView], *, trigger: str, poll: bool = False
    ) -> Decision | None:
        state = self.remember(body)
        return await self._locked(state, lambda: list(pods), trigger, poll)

    async def _locked(
        self, state: JobState, pods: Callable[[], list[PodView]], trigger: str, poll: bool
    ) -> Decision | None:
        async with state.lock:
            if self.closed:
                return None
            started = time.monotonic()
            try:
                observed = state.observe(pods(), time.monotonic())
                return await self._pass(state, observed, trigger, poll)
            except Exception:
                if self.metrics:
                    self.metrics.reconcile_errors.labels(trigger).inc()
                raise
            finally:
                if self.metrics:
                    self.metrics.reconcile_seconds.labels(trigger).observe(
                        time.monotonic() - started
                    )

    async def _pass(
        self, state: JobState, pods: list[PodView], trigger: str, poll: bool
    ) -> Decision | None:
        body = state.body
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            return None
        previous = state.status or _stored_status(body)
        version = _spec_version(body)
        if state.parsed is None or version is None or version != state.parsed_version:
            try:
                state.parsed = parsed(body, state.parsed)
            except (ManifestError, ValueError) as exc:
                await self._invalid(state, previous, str(exc))
                return None
            state.parsed_version = version
        job, job_plan = state.parsed.job, state.parsed.plan
        if previous.phase not in TERMINAL:
            try:
                await self._ensure_children(state, state.parsed)
            except KubeError as exc:
                if not await self._rejected(state, previous, exc):
                    raise
                return None
        if poll and previous.phase not in (*TERMINAL, "Suspended") and self._poll_due(state):
            state.progress = await self._poll(job, state) or state.progress
        decision = decide(
            Observed(
                job=job,
                generation=int(meta.get("generation") or 1),
                status=previous,
                replicas={r.role: len(r.replicas) for r in job_plan.roles},
                pods=pods,
                now=dt.datetime.now(dt.timezone.utc),
                progress=state.progress,
                lost=list(state.lost.values()),
            )
        )
        counted = set(state.lost)
        try:
            await self._act(state, job, job_plan, decision, pods)
        except KubeError as exc:
            if not await self._rejected(state, previous, exc):
                raise
            return None
        if decision.status != previous:
            await self._write_status(state, decision.status)
        if decision.status.phase in TERMINAL and job.spec.scheduling.queue_name:
            await self._release_queue(state, job, pods)
        now = time.monotonic()
        for uid in counted:  # counted once: a repeated DELETED event finds it here
            state.lost.pop(uid, None)
            state.own_deletes[uid] = now
        for ev in decision.events:
            kopf.event(_kopf_body(body), type=ev.type, reason=ev.reason, message=ev.message)
        if decision.restarted and self.metrics:
            self.metrics.restarts.labels(job.namespace).inc()
        if decision.delete_job:
            await self.kube.delete(job_path(job.namespace, job.name), what=f"job {job.name}")
        log.debug(
            "reconciled %s/%s (%s): phase %s",
            job.namespace,
            job.name,
            trigger,
            decision.status.phase,
        )
        return decision

    async def _ensure_children(self, state: JobState, p: Parsed) -> None:
        job, job_plan, data = p.job, p.plan, p.config
        if state.ensured:
            if p.config_hash != state.config_hash:  # the plan changed (scale, edit while suspended)
                await self._patch_config(job_plan, data)
                state.config_hash = p.config_hash
            return
        children = [
            builders.engine_key_secret(
                job_plan,
                secrets.token_urlsafe(32),
                sync_key=secrets.token_urlsafe(32),
                reward_key=secrets.token_urlsafe(32),
            ),
            builders.config_map(job_plan, data),
            builders.service(job_plan),
            builders.network_policy(job_plan, self.config.operator_namespace, state.uid),
        ]
        group = builders.pod_group(job_plan, job)
        if group is not None:
            kopf.adopt([group], owner=_kopf_body(state.body))
            await self._create_pod_group(group)
        kopf.adopt(children, owner=_kopf_body(state.body))
        # A Secret that exists (a restarted operator) is left as it is: the chart's RBAC lets
        # the operator create Secrets, never read or change them.
        results = await asyncio.gather(*(self.kube.create(child) for child in children))
        if results[1] is None:  # the ConfigMap exists: make it match this spec
            await self._patch_config(job_plan, data)
        state.ensured, state.config_hash = True, p.config_hash

    async def _create_pod_group(self, group: dict[str, Any]) -> None:
        """A 404 on create means the cluster does not serve that PodGroup kind (its gang
        scheduler's CRDs are not installed): no retry can succeed, so the job fails and says
        what to install, instead of retrying every few seconds with an empty phase."""
        try:
            await self.kube.create(group)
        except KubeError as exc:
            if exc.status != 404:
                raise
            api = group["apiVersion"]
            installs = {
                "scheduling.volcano.sh/v1beta1": "Volcano (its CRDs and scheduler)",
                "scheduling.x-k8s.io/v1alpha1": "the scheduler-plugins coscheduling plugin and "
                "its PodGroup CRD",
            }
            raise KubeError(
                422,
                "GangSchedulerMissing",
                f"spec.scheduling.gang needs PodGroup {api}, which this cluster does not serve: "
                f"install {installs.get(api, 'its CRD')}, or set spec.scheduling.gang to none",
            ) from exc

    async def _patch_config(self, job_plan: JobPlan, data: dict[str, str]) -> None:
        url = path("v1", "configmaps", job_plan.namespace, builders.config_map_name(job_plan.name))
        await self.kube.merge_patch(url, {"data": data}, what=f"config of {job_plan.name}")

    async def _act(
        self,
        state: JobState,
        job: LoRARLJob,
        job_plan: JobPlan,
        decision: Decision,
        pods: list[PodView],
    ) -> None:
        uids = {p.name: p.uid for p in pods}
        for name in decision.delete:
            if uids.get(name):  # before the call: its DELETED event may come before the reply
                state.own_deletes[uids[name]] = time.monotonic()
            await self.kube.delete(path("v1", "pods", job.namespace, name), what=f"pod {name}")
            if uids.get(name):
                state.deleted[uids[name]] = time.monotonic()
            state.created.pop(name, None)
        pods_to_make = []
        model = decision.status.model  # a hub id's pinned commit, once a pod has fetched it
        for role, index in decision.create:
            attempt = decision.attempt if role == "trainer" else 0
            pods_to_make.append(
                builders.pod(
                    job_plan,
                    job,
                    role,
                    index,
                    attempt=attempt,
                    job_uid=state.uid,
                    model_revision=model.revision if model else None,
                )
            )
        kopf.adopt(pods_to_make, owner=_kopf_body(state.body))
        made = []
        for created in await asyncio.gather(*(self.kube.create(p) for p in pods_to_make)):
            if created is None:
                continue  # that name is still taken (terminating): a later pass retries
            view = pod_view(created)
            if view is not None:
                made.append(view.name)
                state.created[view.name] = (view, time.monotonic())
        if made:
            kopf.event(
                _kopf_body(state.body),
                type="Normal",
                reason="CreatedPods",
                message=f"created {', '.join(made)}",
            )

    async def _release_queue(self, state: JobState, job: LoRARLJob, pods: list[PodView]) -> None:
        """A finished job's pods say Kueue will not retry the group, so Kueue ends its Workload
        and frees the quota once they have all stopped (their engines were stopped early, so
        not every pod succeeded, which is what Kueue waits for otherwise). Once per pod."""
        for pod in pods:
            if pod.uid in state.released:
                continue
            url = path("v1", "pods", job.namespace, pod.name)
            body = {"metadata": {"annotations": {builders.KUEUE_RETRIABLE: "false"}}}
            try:
                await self.kube.merge_patch(url, body, what=f"pod {pod.name}")
            except KubeError as exc:
                if exc.status != 404:
                    raise
            state.released.add(pod.uid)

    async def _write_status(self, state: JobState, status: LoRARLJobStatus) -> None:
        meta = state.body["metadata"]
        status = status.with_columns()  # what `kubectl get lrj` prints
        written = await self.kube.merge_patch(
            job_path(meta.get("namespace") or "default", meta["name"], "status"),
            {"status": status.wire()},
            what=f"status of {meta['name']}",
        )
        state.status, state.phase = status, status.phase
        # The object as the server now has it (parsed JSON: plain already). Kept as the body,
        # the next timer tick finds its version here once the watch delivers it, and does not
        # copy the whole body again.
        if isinstance(written, dict) and (written.get("metadata") or {}).get("uid") == state.uid:
            state.body = written

    async def _rejected(self, state: JobState, previous: LoRARLJobStatus, exc: KubeError) -> bool:
        """The API server refused a child as invalid (400, 422): the same write would be
        refused forever, so the job fails with the server's words instead of retrying. Other
        errors (conflicts, quota, an unreachable server) may pass: the caller retries."""
        if exc.status not in PERMANENT_STATUSES:
            return False
        if exc.reason == "GangSchedulerMissing":  # ours, not the server's: no status prefix
            await self._invalid(state, previous, str(exc).split(": ", 1)[1], reason=exc.reason)
        else:
            await self._invalid(state, previous, str(exc), reason="ChildRejected")
        return True

    async def _invalid(
        self,
        state: JobState,
        previous: LoRARLJobStatus,
        problem: str,
        *,
        reason: str = "InvalidSpec",
    ) -> None:
        """A spec the webhook would have refused (webhook off), or a child the API server
        refused: fail it, do not retry."""
        if previous.phase == "Failed":
            return
        now = rfc3339(dt.datetime.now(dt.timezone.utc))
        gen = int(state.body["metadata"].get("generation") or 1)
        status = previous.model_copy(
            update={
                "phase": "Failed",
                "completion_time": previous.completion_time or now,
                "observed_generation": gen,
                "conditions": set_condition(
                    previous.conditions, "Failed", True, reason, problem, now, gen
                ),
            }
        )
        await self._write_status(state, status)
        kopf.event(_kopf_body(state.body), type="Warning", reason=reason, message=problem)

    def _poll_due(self, state: JobState) -> bool:
        """Whether this tick polls the trainer. A running trainer's report changes once a step
        (its `latest.stepSeconds` apart): until half a tick before the next step is due, a tick
        skips the poll, at most MAX_SKIPPED_POLLS in a row. Without a step time yet it polls
        every tick. The final report does not depend on it (the trainer's termination message
        carries it)."""
        progress, changed = state.progress, state.changed_at
        seconds = progress.latest.step_seconds if progress and progress.latest else None
        if progress is None or progress.phase != "Running" or not seconds or changed is None:
            return True
        due = changed + seconds - self.config.timer_seconds / 2
        if time.monotonic() >= due or state.skipped >= MAX_SKIPPED_POLLS:
            state.skipped = 0
            return True
        state.skipped += 1
        return False

    async def _poll(self, job: LoRARLJob, state: JobState | None = None) -> Progress | None:
        """The trainer's report; the one `state` holds when the trainer sent the same bytes
        again (between two steps it does: the same report is not parsed and validated again,
        and the pass sees the very same object)."""
        url = f"{self.config.progress_base(job.namespace, job.name)}/progress"
        try:  # capped in bytes and total time: a slow or huge answer must not stall reconciles
            async with self._polls:
                if self._progress is None:
                    self._progress = progress_fetch.session(self.config.progress_timeout, POLLS)
                raw = await progress_fetch.fetch_bytes(
                    self._progress, url, max_bytes=MAX_PROGRESS_BYTES
                )
            if state is not None and state.progress is not None and raw == state.progress_raw:
                return state.progress
            progress = Progress.model_validate(progress_fetch.parse_json(url, raw))
        except (FetchError, ValueError) as exc:  # not up yet, restarting, gone, or junk
            log.debug("no progress from %s: %s", url, exc)
            return None
        if state is not None:
            state.progress_raw, state.changed_at = raw, time.monotonic()
        return progress


def _same_version(kept: Mapping[str, Any], meta: Mapping[str, Any]) -> bool:
    """Whether `meta` is of the object version `kept` was copied from: the API server gives
    every write a new resourceVersion, so the same one is the same content."""
    version = meta.get("resourceVersion")
    return bool(version) and version == (kept.get("metadata") or {}).get("resourceVersion")


def _spec_version(body: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What `parsed` reads from the body, by version: the API server moves a custom
    resource's `metadata.generation` on every spec change (the status subresource is on), and
    labels do not move it, so they are compared. None (parse again) without a generation."""
    meta = body.get("metadata") or {}
    generation = meta.get("generation")
    if generation is None:
        return None
    labels = meta.get("labels") or {}
    return (meta.get("uid"), generation, body.get("apiVersion"), tuple(sorted(labels.items())))


def _kopf_body(body: dict[str, Any]) -> kopf.Body:
    """The plain copy of a job's body this process keeps, for kopf.event and kopf.adopt: they
    read only its apiVersion, kind and metadata (with `.get`), but are annotated with kopf's
    live `Body` view, which a plain dict is not."""
    return cast("kopf.Body", body)


def _stored_status(body: Mapping[str, Any]) -> LoRARLJobStatus:
    try:
        return LoRARLJobStatus.model_validate(body.get("status") or {})
    except ValidationError:
        return LoRARLJobStatus()  # written by another version: start over, keep nothing
