"""The trainer's choice of sync members and serving replicas (`trainer/fleet/membership.py`),
against a
scripted sender and real HTTP sidecar endpoints (tiny servers answering /healthz)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from lorarl.jsonhttp import JsonHttpServer
from lorarl.local.ports import free_port
from lorarl.sync.errors import SyncTransportError
from lorarl.sync.transport import Registration
from lorarl.trainer.fleet.membership import Fleet, NoEngineReady, probe_sidecar
from lorarl.trainer.fleet.publish import SyncFailed


class Sidecar:
    """A /healthz endpoint whose answer the test sets (code, version, the incarnation it
    answers for)."""

    def __init__(self) -> None:
        self.code, self.version = 503, None
        self.incarnation: str | None = "aa"
        self.port = free_port()
        self.server = JsonHttpServer(
            {"/healthz": lambda: (self.code, {"ok": self.code == 200, "version": self.version,
                                              "incarnation": self.incarnation})},
            self.port,
            "127.0.0.1",
        )  # fmt: skip
        self.server.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def member(self, index: int, incarnation: str = "aa") -> Registration:
        return Registration(index, incarnation, f"http://engine-{index}:1", self.url)


class ScriptedSender:
    def __init__(self) -> None:
        self.registrations: list[Registration] = []
        self.members: tuple[Registration, ...] = ()
        self.latest_version: int | None = None
        self.waited: list[int] = []

    def registered(self) -> list[Registration]:
        return list(self.registrations)

    def wait_registered(self, count: int, timeout: float) -> list[Registration]:
        self.waited.append(count)
        return self.registered()


class ScriptedPublisher:
    """Records who each sync went to; fails the first `failures` syncs like a dead peer."""

    def __init__(self, sidecars: dict[int, Sidecar], failures: int = 0) -> None:
        self.sender = ScriptedSender()
        self.sidecars, self.failures = sidecars, failures
        self.never_joins: set[int] = set()  # indexes whose group formation always fails
        self.sent: list[tuple[int, list[int]]] = []

    def _deliver(self, version: int, members: list[Registration]) -> None:
        self.sender.members = tuple(members)
        self.sender.latest_version = version
        for m in members:
            sc = self.sidecars[m.index]
            sc.code, sc.version = 200, version

    def publish(self, model, tensors, version, members):
        if self.failures:
            self.failures -= 1
            raise SyncTransportError("peer closed the connection")
        if self.never_joins & {m.index for m in members}:
            self.sender.members = ()  # the group broke for everyone
            raise SyncTransportError("rendezvous timed out waiting for rank 3")
        self.sent.append((version, [m.index for m in members]))
        self._deliver(version, members)
        return type("Status", (), {"version": version, "members": len(members)})()

    def catch_up(self, members) -> bool:
        if tuple(members) == self.sender.members:
            return False
        if self.never_joins & {m.index for m in members}:
            self.sender.members = ()  # the group broke for everyone
            raise SyncTransportError("rendezvous timed out waiting for rank 3")
        self.sent.append((self.sender.latest_version, [m.index for m in members]))
        self._deliver(self.sender.latest_version, members)
        return True


@pytest.fixture
def sidecars() -> Iterator[dict[int, Sidecar]]:
    made = {i: Sidecar() for i in range(3)}
    yield made
    for sc in made.values():
        sc.server.stop()


def make_fleet(publisher: ScriptedPublisher, http: httpx.Client, **kw) -> Fleet:
    return Fleet(publisher, http, initial_members=2, retry_s=0.01, sleep=lambda s: None, **kw)


def test_a_sync_goes_to_registered_members_that_answer(sidecars) -> None:
    publisher = ScriptedPublisher(sidecars)
    publisher.sender.registrations = [sidecars[0].member(0), sidecars[1].member(1)]
    sidecars[1].server.stop()  # registered, but its pod is gone
    with httpx.Client(timeout=1.0) as http:
        fleet = make_fleet(publisher, http)
        fleet.publish(None, {}, 1)
    assert publisher.sender.waited == [2]  # the first sync waits for the job's start count
    assert publisher.sent == [(1, [0])]


def test_a_restarted_sidecar_joins_only_once_it_answers_as_its_new_registration(sidecars) -> None:
    """The old registration is still in the store while the new process already answers at the
    same address: a group formed around the old one would wait for a process that is gone."""
    publisher = ScriptedPublisher(sidecars)
    publisher.sender.registrations = [sidecars[0].member(0), sidecars[1].member(1, "old")]
    sidecars[1].incarnation = None  # the new process is up but has not registered yet
    with httpx.Client(timeout=1.0) as http:
        fleet = make_fleet(publisher, http)
        fleet.publish(None, {}, 1)
        assert publisher.sent == [(1, [0])]
        sidecars[1].incarnation = "new"  # registered, but the trainer still reads the old entry
        assert [m.index for m, _ in fleet.live()] == [0]
        publisher.sender.registrations[1] = sidecars[1].member(1, "new")
        assert [m.index for m, _ in fleet.live()] == [0, 1]
        fleet.serving()
        assert publisher.sent[-1] == (1, [0, 1])


def test_a_member_that_dies_mid_sync_costs_a_retry_not_the_step(sidecars) -> None:
    publisher = ScriptedPublisher(sidecars, failures=2)
    publisher.sender.registrations = [sidecars[0].member(0), sidecars[1].member(1)]
    with httpx.Client(timeout=1.0) as http:
        fleet = make_fleet(publisher, http)
        status = fleet.publish(None, {}, 1)
        assert status.members == 2 and publisher.sent == [(1, [0, 1])]
        publisher.failures = 10
        with pytest.raises(SyncFailed, match="failed 4 times: peer closed"):
            fleet.publish(None, {}, 2)


def test_only_replicas_on_the_latest_version_serve_and_newcomers_catch_up_first(sidecars) -> None:
    publisher = ScriptedPublisher(sidecars)
    publisher.sender.registrations = [sidecars[0].member(0), sidecars[1].member(1)]
    with httpx.Client(timeout=1.0) as http:
        fleet = make_fleet(publisher, http)
        fleet.publish(None, {}, 1)
        assert fleet.serving() == {
            "http://engine-0:1": "rollout-0",
            "http://engine-1:1": "rollout-1",
        }
        # rollout-2 registers with a fresh sidecar (no weights yet: 503, version None)
        publisher.sender.registrations.append(sidecars[2].member(2))
        serving = fleet.serving()
        assert publisher.sent[-1] == (1, [0, 1, 2])  # the current version re-sent to all three
        assert set(serving.values()) == {"rollout-0", "rollout-1", "rollout-2"}
        # a replica whose engine restarted answers 503 (re-applying): left out meanwhile
        sidecars[0].code = 503
        assert set(fleet.serving().values()) == {"rollout-1", "rollout-2"}
        # one that claims 200 on an older version is left out too
        sidecars[0].code, sidecars[0].version = 200, 0
        assert set(fleet.serving().values()) == {"rollout-1", "rollout-2"}


def test_a_newcomer_that_cannot_join_does_not_stop_the_others_generating(sidecars) -> None:
    """A failed re-forming breaks the group, but the engines already on the latest version still
    serve it: they generate while the newcomer tries again (it used to stall every step until
    the engine-ready timeout)."""
    publisher = ScriptedPublisher(sidecars)
    publisher.sender.registrations = [sidecars[0].member(0), sidecars[1].member(1)]
    with httpx.Client(timeout=1.0) as http:
        fleet = make_fleet(publisher, http, ready_timeout_s=0.5)
        fleet.publish(None, {}, 1)
        publisher.sender.registrations.append(sidecars[2].member(2))
        publisher.never_joins = {2}
        assert set(fleet.serving().values()) == {"rollout-0", "rollout-1"}
        publisher.never_joins = set()  # it joins on a later round and serves from then on
        assert set(fleet.serving().values()) == {"rollout-0", "rollout-1", "rollout-2"}
        assert publisher.sent[-1] == (1, [0, 1, 2])


def test_a_newcomer_that_cannot_join_costs_the_sync_one_retry_not_the_job(sidecars) -> None:
    """It registered after the last group formed and its join fails: the retry goes to the
    members synced before (before, all four attempts included it and the job failed)."""
    publisher = ScriptedPublisher(sidecars)
    publisher.sender.registrations = [sidecars[0].member(0), sidecars[1].member(1)]
    with httpx.Client(timeout=1.0) as http:
        fleet = make_fleet(publisher, http)
        fleet.publish(None, {}, 1)
        publisher.sender.registrations.append(sidecars[2].member(2))
        publisher.never_joins = {2}
        status = fleet.publish(None, {}, 2)
        assert status.members == 2 and publisher.sent[-1] == (2, [0, 1])
        publisher.never_joins = set()  # it joins from the next round on
        assert set(fleet.serving().values()) == {"rollout-0", "rollout-1", "rollout-2"}
        assert publisher.sent[-1] == (2, [0, 1, 2])


def test_no_replica_on_the_latest_weights_is_a_clear_error_after_the_timeout(sidecars) -> None:
    publisher = ScriptedPublisher(sidecars)
    publisher.sender.registrations = [sidecars[0].member(0)]
    with httpx.Client(timeout=1.0) as http:
        fleet = make_fleet(publisher, http, ready_timeout_s=0.2)
        fleet.publish(None, {}, 3)
        sidecars[0].code = 503
        with pytest.raises(NoEngineReady, match="no rollout replica served weight version 3"):
            fleet.serving()


def test_probe_tells_unreachable_from_not_ready(sidecars) -> None:
    with httpx.Client(timeout=1.0) as http:
        sidecars[0].code, sidecars[0].version = 503, 4
        found = probe_sidecar(http, sidecars[0].url)
        assert (found.live, found.code, found.version) == (True, 503, 4)
        sidecars[1].server.stop()
        assert not probe_sidecar(http, sidecars[1].url).live
