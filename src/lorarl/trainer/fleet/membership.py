"""The rollout replicas of a running job: which ones take part in the weight sync and which ones
may generate (docs/architecture.md#live-membership).

The trainer's start-up env says how many replicas the job began with, not how many it has now:
`kubectl scale` adds and removes pods, and a preempted pod comes back as a new process. So each
sync sidecar registers itself in the sync store (signed with the job key, with its engine's and
its own URL), and between steps the trainer reads the registrations. A member is *live* when its
sidecar answers HTTP (a deleted pod's does not) as the incarnation that registered: a restarted
sidecar answers at its old address before it has registered again, and a group formed around its
old registration would wait for a process that no longer exists. The sync group always holds
exactly the live members, re-formed when that set changes, and a newcomer gets the current
adapter before anything else. A replica *serves* a step only when its sidecar says its engine
is up and on the trainer's latest version, and (the stale-policy guard, `sync_check.py`) its
engine itself has shown it serves that version, so no sample ever comes from weights the trainer
did not publish. An engine that fails the check is re-synced once; failing again stops the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import httpx
import torch
from peft import PeftModel

from lorarl.api.reports.status import SyncStatus
from lorarl.api.resource import LoRARLJob
from lorarl.sync.errors import SyncTransportError
from lorarl.sync.protocol import adapter_name
from lorarl.sync.transport import Registration
from lorarl.trainer.errors import ConfigError
from lorarl.trainer.fleet.publish import SyncFailed, WeightPublisher
from lorarl.trainer.fleet.sync_check import StalePolicy, SyncCheck
from lorarl.trainer.model.parallel import DistContext, compute_dtype

log = logging.getLogger(__name__)

PUBLISH_ATTEMPTS = 4  # a member that died mid-sync is dropped and the sync retried without it
ENGINE_READY_TIMEOUT_S = 900.0  # engines (re)starting: model load and warm-up on big models
INITIAL_MEMBERS_TIMEOUT_S = 600.0  # the first sync waits this long for the job's replicas


class NoEngineReady(RuntimeError):
    pass


class SyncEndpoints(Protocol):
    """What `Fleet.from_job` reads of the trainer's `settings.Endpoints` (the settings sit above
    the fleet: docs/architecture.md, Layers)."""

    @property
    def rollout(self) -> list[str]: ...

    @property
    def sync_addr(self) -> str | None: ...

    @property
    def sync_port(self) -> int | None: ...

    @property
    def sync_world_size(self) -> int: ...

    @property
    def sync_backend(self) -> str | None: ...

    @property
    def engine_api_key(self) -> str | None: ...


def replica_name(index: int) -> str:
    return f"rollout-{index}"


@dataclass(frozen=True)
class Probe:
    """One sidecar's `/healthz`: None when it did not answer (the pod is gone or restarting).
    `incarnation`: the registration it answers for, None before it has registered."""

    code: int | None
    version: int | None = None
    incarnation: str | None = None

    @property
    def live(self) -> bool:
        return self.code is not None


def probe_sidecar(http: httpx.Client, url: str) -> Probe:
    try:
        reply = http.get(f"{url}/healthz")
    except httpx.HTTPError:
        return Probe(None)
    try:
        body = reply.json()
        version, incarnation = body.get("version"), body.get("incarnation")
    except (ValueError, AttributeError):
        version = incarnation = None
    return Probe(
        reply.status_code,
        version if isinstance(version, int) else None,
        incarnation if isinstance(incarnation, str) else None,
    )


class Fleet:
    """Rank 0's view of the rollout replicas; owns who receives each sync and who generates."""

    def __init__(
        self,
        publisher: WeightPublisher,
        http: httpx.Client,
        initial_members: int,
        *,
        ready_timeout_s: float = ENGINE_READY_TIMEOUT_S,
        initial_timeout_s: float = INITIAL_MEMBERS_TIMEOUT_S,
        retry_s: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
        guard: SyncCheck | None = None,
    ):
        self.publisher, self.http = publisher, http
        self.guard = guard
        self.initial_members = initial_members
        self.ready_timeout_s, self.initial_timeout_s = ready_timeout_s, initial_timeout_s
        self.retry_s, self._sleep = retry_s, sleep
        self._published = False
        self.names: dict[str, str] = {}  # engine URL -> replica name, of every member seen

    @classmethod
    def from_job(
        cls,
        job: LoRARLJob,
        endpoints: SyncEndpoints,
        http: httpx.Client,
        ctx: DistContext,
        probe: list[int] | None,
    ) -> Fleet | None:
        """Rank 0's fleet with sidecars (None without): the weight publisher, which hosts the
        sync store the sidecars register in, and the stale-policy guard when `probe` is set
        (`sync_check.job_probe_ids`). Who receives each sync and who generates: the replicas
        registered now, not the ones in this env (docs/architecture.md#live-membership)."""
        if endpoints.sync_world_size <= 1:
            return None
        addr, port, backend = endpoints.sync_addr, endpoints.sync_port, endpoints.sync_backend
        if addr is None or port is None or backend is None:
            raise ConfigError(
                "LORARL_SYNC_ADDR/LORARL_SYNC_PORT/LORARL_SYNC_BACKEND are required with sidecars"
            )
        spec = job.spec
        publisher = WeightPublisher(
            addr, port, spec.rollout.sync_mode, backend=backend,
            wire_dtype=compute_dtype(ctx, spec.trainer.fsdp.mixed_precision),
        )  # fmt: skip
        guard = None if probe is None else SyncCheck.from_job(job, http, endpoints.engine_api_key)
        return cls(publisher, http, initial_members=len(endpoints.rollout), guard=guard)

    # ------------------------------------------------------------------ membership

    def live(self) -> list[tuple[Registration, Probe]]:
        """Registered members whose sidecar answers as that registration, with what it said."""
        out = []
        for member in self.publisher.sender.registered():
            if member.sidecar:
                found = probe_sidecar(self.http, member.sidecar)
            else:
                found = Probe(200, incarnation=member.incarnation)
            if found.live and found.incarnation == member.incarnation:
                out.append((member, found))
                if member.engine:
                    self.names[member.engine] = replica_name(member.index)
        return out

    def _first_members(self) -> None:
        """Before the first sync: wait (bounded) until the replicas the job started with have
        registered, so the first step generates on all of them."""
        sender = self.publisher.sender
        found = sender.wait_registered(self.initial_members, self.initial_timeout_s)
        if len(found) < self.initial_members:
            log.warning(
                "%d of %d rollout replicas registered within %.0f s; starting with those "
                "(the others join when they register)",
                len(found), self.initial_members, self.initial_timeout_s,
            )  # fmt: skip

    # ------------------------------------------------------------------ sync

    def publish(
        self, model: PeftModel, tensors: dict[str, torch.Tensor], version: int
    ) -> SyncStatus:
        """Send `version` to every live member. A member that dies mid-sync breaks the group for
        everyone: the sync is retried with the members still alive, so the step goes on. A
        newcomer (registered since the last group formed) may be what broke it (its gloo join
        failed): retries go to the last group's live members, and newcomers join in `catch_up`,
        as they would have from `serving`."""
        if not self._published:
            self._first_members()
            self._published = True
        synced = set(self.publisher.sender.members)  # the last group (empty once it broke)
        error: Exception | None = None
        for attempt in range(PUBLISH_ATTEMPTS):
            members = [m for m, _ in self.live()]
            if attempt and synced:
                members = [m for m in members if m in synced] or members
            try:
                return self.publisher.publish(model, tensors, version, members)
            except SyncTransportError as exc:
                error = exc
                log.warning("sync of version %d (attempt %d): %s", version, attempt + 1, exc)
                self._sleep(self.retry_s * 2**attempt)
        raise SyncFailed(
            f"weight sync of version {version} failed {PUBLISH_ATTEMPTS} times: {error}"
        )

    def catch_up(self) -> list[tuple[Registration, Probe]]:
        """Re-form the group around the live members if it changed and re-send the latest
        version (adapter bytes only); the probes after it. When the re-forming fails (a
        newcomer died or is too slow to join), the probes from before it: the members already on
        the latest version go on generating, and the newcomers try again next round."""
        members = self.live()
        try:
            resent = self.publisher.catch_up([m for m, _ in members])
        except SyncTransportError as exc:
            log.warning("bringing new sidecars up to date failed; next round: %s", exc)
            return members
        return self.live() if resent else members  # versions moved: ask again

    # ------------------------------------------------------------------ generation

    def serving(self) -> dict[str, str]:
        """Engine URL -> replica name of the replicas on the latest version, after bringing any
        newcomer up to date; waits (bounded) until there is at least one."""
        latest = self.publisher.sender.latest_version
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            members = self.catch_up()
            claimed = [
                m
                for m, found in members
                if m.engine and found.code == 200 and found.version == latest
            ]
            if self.guard is not None and latest is not None:
                claimed = self._prove(claimed, latest)
            ready = {m.engine: replica_name(m.index) for m in claimed}
            if ready:
                if len(ready) < len(members):
                    log.warning("generating on %d of %d engines (others catching up)",
                                len(ready), len(members))  # fmt: skip
                return ready
            if time.monotonic() > deadline:
                raise NoEngineReady(
                    f"no rollout replica served weight version {latest} within "
                    f"{self.ready_timeout_s:.0f} s ({len(members)} registered and reachable)"
                )
            self._sleep(self.retry_s)

    def _prove(self, claimed: list[Registration], version: int) -> list[Registration]:
        """The members whose engine shows it serves `version` (sync_check.py). One that does not
        gets the version again; if it still does not, StalePolicy names it."""
        guard = self.guard
        assert guard is not None
        name = adapter_name(version)
        failed = []
        for m in claimed:
            if guard.proven(m.engine, m.incarnation, version):
                continue
            verdict = guard.check(m.engine, m.incarnation, version, name)
            if not verdict.ok:
                log.warning("%s (%s) does not serve weight version %d: %s; re-syncing it",
                            replica_name(m.index), m.engine, version, verdict.reason)  # fmt: skip
                failed.append(m)
        if failed:
            try:
                self.publisher.catch_up([m for m, _ in self.live()], force=True)
            except SyncTransportError as exc:  # the check below says what the engine serves
                log.warning("re-sync of version %d failed: %s", version, exc)
            for m in failed:
                verdict = guard.check(m.engine, m.incarnation, version, name)
                if not verdict.ok:
                    raise StalePolicy(
                        f"{replica_name(m.index)} ({m.engine}) does not serve weight version "
                        f"{version} after a re-sync: {verdict.reason}. Its sidecar acknowledged "
                        "the update; check the sidecar's and the engine's logs"
                    )
        return [m for m in claimed if guard.proven(m.engine, m.incarnation, version)]
