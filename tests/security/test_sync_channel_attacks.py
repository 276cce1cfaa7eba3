"""The attacks of issue 16 against the weight-sync channel, each as a test.

The pytest process is trainer rank 0 (a real `SyncSender`: TCPStore + gloo on loopback); the
sidecars are real `SyncReceiver`s in threads, each looping as the sidecar does and recording
what it got, what it refused, and the exception it would have died of. The attacker is a plain
TCPStore client: the store has no access control, so it can write any key. Every test failed
against the unsigned channel (see docs/security.md): a receiver crashed, obeyed a forged close,
accepted tampered bytes, or the store answered on an address it was not given.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist

from lorarl.sync import transport
from lorarl.sync.auth import Signer
from lorarl.sync.buckets import Bucket, SyncHeader, TensorEntry
from lorarl.sync.errors import SyncClosed, SyncRefused, SyncTransportError
from lorarl.sync.transport import SyncReceiver, SyncSender

HOST = "127.0.0.1"
KEY = "the-job-sync-key"
TIMEOUT = 8.0  # store and group timeouts: an attack that wedges a side fails in seconds
MODULES = ("model.layers.0.self_attn.q_proj",)

pytestmark = pytest.mark.timeout(120)


def update(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    module = f"base_model.model.{MODULES[0]}"
    return {
        f"{module}.lora_A.weight": torch.randn(4, 32, generator=g),
        f"{module}.lora_B.weight": torch.randn(32, 4, generator=g).to(torch.bfloat16),
    }


def header(version: int) -> SyncHeader:
    return SyncHeader(
        version=version, mode="merged", scaling=2.0, rank=4, alpha=8.0, target_modules=MODULES
    )


class Sidecar:
    """A receiver thread that serves like the sidecar: every update is acked, a refusal or a
    transport error is survived, anything else is what the process would have crashed on."""

    def __init__(self, port: int, rank: int):
        self.rank = rank
        self.events: queue.Queue[tuple] = queue.Queue()
        self.got: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.receiver: SyncReceiver | None = None
        self._stop = threading.Event()
        args = (port, rank)
        self.thread = threading.Thread(target=self._serve, args=args, daemon=True)
        self.thread.start()

    def _serve(self, port: int, rank: int) -> None:
        transport_errors = 0
        try:
            self.receiver = SyncReceiver(HOST, port, rank, "gloo", timeout=TIMEOUT, key=KEY)
            while not self._stop.is_set():
                try:
                    received = self.receiver.recv(timeout=0.2)
                except TimeoutError:
                    continue
                except SyncRefused as exc:
                    self.events.put(("refused", str(exc)))
                    continue
                except SyncTransportError as exc:
                    self.events.put(("transport", str(exc)))
                    transport_errors += 1
                    if transport_errors == 3:  # the sidecar gives up too: the store is gone
                        return
                    continue
                transport_errors = 0
                version = received.header.version
                self.got.append((version, {k: v.clone() for k, v in received.tensors.items()}))
                self.receiver.ack(version)
                self.events.put(("update", version))
        except SyncClosed:
            self.events.put(("closed",))
        except BaseException as exc:  # what would have taken the sidecar down
            self.events.put(("crashed", repr(exc)))

    def kill(self) -> None:
        """Stop serving and drop the group, like a sidecar whose pod died."""
        self._stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()
        if self.receiver is not None:
            self.receiver.close()

    def next_event(self, timeout: float = 20.0) -> tuple:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"sidecar {self.rank}: nothing happened in {timeout} s") from None

    def alive(self) -> bool:
        return self.thread.is_alive()


class Attacker:
    """Anyone who can reach the store's port."""

    def __init__(self, port: int):
        self.store = dist.TCPStore(HOST, port, None, False, timedelta(seconds=TIMEOUT))
        self.ctl = dist.PrefixStore("lorarl-sync/ctl", self.store)

    def write(self, key: str, value: str | bytes) -> None:
        self.ctl.set(key, value)

    def read(self, key: str) -> bytes:
        return self.ctl.get(key)

    def next_seq(self) -> int:
        n = 0
        while self.ctl.check([f"announce/{n}"]):
            n += 1
        return n


@pytest.fixture
def channel() -> Iterator[tuple[SyncSender, list[Sidecar], Attacker]]:
    sender = SyncSender(HOST, 0, backend="gloo", timeout=TIMEOUT, key=KEY)
    sidecars = [Sidecar(sender.port, rank) for rank in (1, 2)]
    assert len(sender.wait_registered(2, TIMEOUT)) == 2
    first = sender.send(update(1), header(1))
    assert first.ok, first
    for s in sidecars:
        assert s.next_event() == ("update", 1)
    yield sender, sidecars, Attacker(sender.port)
    sender.close(wait=1.0)
    for s in sidecars:
        s.kill()


def assert_serving(sender: SyncSender, sidecars: list[Sidecar], version: int) -> None:
    """Every sidecar is alive and takes the next genuine update, bit for bit."""
    result = sender.send(update(version), header(version))
    assert result.ok, result
    for s in sidecars:
        event = s.next_event()
        assert event == ("update", version), (s.rank, event)
        got_version, tensors = s.got[-1]
        assert got_version == version
        for name, t in update(version).items():
            assert torch.equal(tensors[name], t), name


def settle(sidecars: list[Sidecar], seconds: float = 0.5) -> None:
    """Give the receivers time to read what the attacker wrote; none may have died of it."""
    time.sleep(seconds)
    for s in sidecars:
        assert s.alive(), f"sidecar {s.rank} died: {s.events.queue}"
        assert s.events.empty(), (s.rank, list(s.events.queue))


# -- forged announcements ---------------------------------------------------------------------

POISON = {
    "non-JSON": b"\xff\xfe{{ not json",
    "not an object": b"[1, 2, 3]",
    "wrong types": json.dumps({"op": "sync", "generation": "0", "seq": None}),
    "unknown op": json.dumps({"op": "format-disk", "generation": 0}),
    "huge": b"x" * (4 * 1024 * 1024),
}


def test_malformed_announcements_are_ignored_and_every_sidecar_keeps_serving(channel) -> None:
    sender, sidecars, attacker = channel
    for version, value in enumerate(POISON.values(), start=2):
        attacker.write(f"announce/{attacker.next_seq()}", value)
        settle(sidecars)
        assert_serving(sender, sidecars, version)


def test_a_forged_close_does_not_stop_the_sidecars(channel) -> None:
    sender, sidecars, attacker = channel
    seq = attacker.next_seq()
    for forged in (
        {"op": "close", "generation": 0},
        {"op": "close", "generation": 0, "seq": seq, "mac": "00" * 32},
        {"op": "close", "generation": 0, "seq": seq, "mac": Signer(b"guess").mac(
            "announce", 0, seq, b'{"generation":0,"op":"close","seq":%d}' % seq).hex()},
    ):  # fmt: skip
        attacker.write(f"announce/{seq}", json.dumps(forged))
        attacker.write("seq", json.dumps({"seq": seq}))
        settle(sidecars)
    assert_serving(sender, sidecars, 2)
    sender.close()
    for s in sidecars:  # only the trainer's own close stops them
        assert s.next_event() == ("closed",)


def test_a_replayed_announcement_does_not_count_for_another_operation(channel) -> None:
    """The first operation's genuine, signed announcement copied to the next operation's key:
    taken at face value it sends every sidecar into a broadcast nobody makes, and the trainer's
    real next operation (here: close) is never seen."""
    sender, sidecars, attacker = channel
    seq = attacker.next_seq()
    attacker.write(f"announce/{seq}", attacker.read("announce/0"))
    settle(sidecars)
    sender.close(wait=TIMEOUT)
    for s in sidecars:
        assert s.next_event(timeout=TIMEOUT) == ("closed",)
    assert attacker.ctl.check([f"closed/{seq}/1", f"closed/{seq}/2"])


def test_poisoned_counters_do_not_cut_anyone_off_the_store(channel) -> None:
    """The store server drops a client that increments a non-number: junk in a counter that
    the trainer or the sidecars `add` to would cut them off the store for good."""
    sender, sidecars, attacker = channel
    seq = attacker.next_seq()
    for key in ("rejoin", "rejoin/1", f"closed/{seq}", f"closed/{seq}/1"):
        attacker.write(key, b"not a number")
    settle(sidecars)
    assert_serving(sender, sidecars, 2)  # junk reads as a rejoin request: a new generation
    assert sender.generation == 1
    sender.close(wait=TIMEOUT)
    for s in sidecars:
        assert s.next_event(timeout=TIMEOUT) == ("closed",)


# -- lying or forged headers and payloads ------------------------------------------------------


def _lie(spec_entries: tuple[TensorEntry, ...], how: str) -> tuple[TensorEntry, ...]:
    first, *rest = spec_entries
    lies = {
        "offset past the bucket": {"offset": 1 << 20},
        "misaligned offset": {"offset": first.offset + 1},
        "shape that is not numel": {"shape": (first.numel + 1, 1)},
        "overlapping tensors": {"offset": rest[0].offset} if rest else {},
    }
    return (first.model_copy(update=lies[how]), *rest)


@pytest.mark.parametrize(
    "how",
    ["offset past the bucket", "misaligned offset", "shape that is not numel",
     "overlapping tensors"],
)  # fmt: skip
def test_a_header_that_lies_about_its_layout_is_nacked_with_the_reason(
    channel, monkeypatch, how: str
) -> None:
    sender, sidecars, _ = channel
    real_pack = transport.pack

    def lying_pack(*args, **kwargs) -> list[Bucket]:
        buckets = real_pack(*args, **kwargs)
        spec = buckets[0].spec
        lied = spec.model_copy(update={"entries": _lie(spec.entries, how)})
        return [Bucket(lied, buckets[0].buffer), *buckets[1:]]

    monkeypatch.setattr(transport, "pack", lying_pack)
    result = sender.send(update(2), header(2))
    assert not result.ok
    assert [a.rank for a in result.failed] == [1, 2]
    for ack in result.failed:
        assert "bad layout" in ack.message, ack.message
    for s in sidecars:
        kind, message = s.next_event()
        assert kind == "refused" and "bad layout" in message, (kind, message)
    monkeypatch.setattr(transport, "pack", real_pack)
    assert_serving(sender, sidecars, 3)


def test_bytes_changed_after_signing_are_refused(channel, monkeypatch) -> None:
    """Whoever sits in rank 0's place in the group (its rendezvous address is a store key
    anyone can overwrite) sends other bytes than the header promises: nothing is applied."""
    sender, sidecars, _ = channel
    ep = sender._ep
    real_broadcast = ep.broadcast

    since_length = [0]  # each operation: int64 length, uint8 header, then uint8 buckets

    def tampering(tensor: torch.Tensor) -> None:
        since_length[0] = 0 if tensor.dtype == torch.int64 else since_length[0] + 1
        if since_length[0] >= 2:
            tensor = tensor.clone()
            tensor[-1] ^= 0xFF
        real_broadcast(tensor)

    monkeypatch.setattr(ep, "broadcast", tampering)
    result = sender.send(update(2), header(2))
    assert not result.ok
    for ack in result.failed:
        assert "SHA-256" in ack.message, ack.message
    for s in sidecars:
        assert s.next_event()[0] == "refused"
        assert [v for v, _ in s.got] == [1]
    monkeypatch.setattr(ep, "broadcast", real_broadcast)
    assert_serving(sender, sidecars, 3)


def test_a_header_not_signed_with_the_job_key_is_refused(channel, monkeypatch) -> None:
    """A rogue rank 0 without the key: the sidecars leave the group, say why, and rejoin."""
    sender, sidecars, _ = channel
    rogue = Signer(b"not-the-job-key")
    monkeypatch.setattr(sender._signer, "seal_header", rogue.seal_header)
    with pytest.raises(SyncTransportError, match="bad MAC"):
        sender.send(update(2), header(2))
    for s in sidecars:
        kind, message = s.next_event()
        assert kind == "refused" and "bad MAC" in message, (kind, message)
    monkeypatch.undo()
    assert_serving(sender, sidecars, 3)


def test_an_acknowledgement_not_signed_with_the_job_key_counts_as_a_failure(
    channel, monkeypatch
) -> None:
    """Whoever answers in a receiver's rank without the key (it took the rank's place in the
    rendezvous, which the store cannot prevent) cannot tell the trainer "applied": its ack is a
    failure, whatever it claims, and the genuine receiver's ack still counts."""
    sender, sidecars, _ = channel
    rogue = Signer(b"not-the-job-key")
    impostor = sidecars[0].receiver
    assert impostor is not None
    monkeypatch.setattr(impostor._signer, "ack", rogue.ack)
    result = sender.send(update(2), header(2))
    assert not result.ok
    by_rank = {a.rank: a for a in result.acks}
    assert not by_rank[1].ok and "acknowledgement refused" in by_rank[1].message
    assert "bad MAC" in by_rank[1].message
    assert by_rank[2].ok and by_rank[2].version == 2
    assert [f.rank for f in result.failed] == [1]
    for s in sidecars:
        assert s.next_event() == ("update", 2)
    monkeypatch.undo()
    assert_serving(sender, sidecars, 3)


def test_an_ack_replayed_from_another_operation_does_not_verify() -> None:
    """The MAC binds an ack to its receiver, generation and operation: a genuine "applied" for
    version 2 cannot be replayed for the next operation or by another replica."""
    from lorarl.sync.group import decode_ack, encode_ack

    signer = Signer(KEY.encode())
    sealed = encode_ack(2, True, "", torch.device("cpu"), seal=partial(signer.ack, 1, 0, 5))
    assert decode_ack(1, sealed, partial(signer.check_ack, 1, 0, 5)).ok
    for index, generation, seq in ((1, 0, 6), (2, 0, 5), (1, 1, 5)):
        ack = decode_ack(index, sealed, partial(signer.check_ack, index, generation, seq))
        assert not ack.ok and "bad MAC" in ack.message, (index, generation, seq)
    unsealed = encode_ack(2, True, "", torch.device("cpu"))
    assert not decode_ack(1, unsealed, partial(signer.check_ack, 1, 0, 5)).ok


def test_an_absurd_header_length_is_refused_without_allocating_it(channel, monkeypatch) -> None:
    sender, sidecars, _ = channel
    ep = sender._ep
    real_broadcast = ep.broadcast
    lied: list[bool] = []

    def huge_length(tensor: torch.Tensor) -> None:
        if tensor.dtype == torch.int64 and not lied:
            lied.append(True)
            tensor = torch.tensor([1 << 50], dtype=torch.int64)
        real_broadcast(tensor)

    monkeypatch.setattr(ep, "broadcast", huge_length)
    with pytest.raises(SyncTransportError):
        sender.send(update(2), header(2))
    for s in sidecars:
        kind, message = s.next_event()
        assert kind == "refused" and "header length" in message, (kind, message)
    monkeypatch.undo()
    assert_serving(sender, sidecars, 3)


# -- forged members ----------------------------------------------------------------------------


def test_forged_or_moved_registrations_never_join_the_group(channel) -> None:
    """The store is open to anyone who reaches it; membership is not. A registration the
    attacker writes (its URLs would receive prompts and the engine key) does not verify, and a
    genuine one copied to another index does not either: the group stays the real sidecars."""
    sender, sidecars, attacker = channel
    real = attacker.read("member/1")
    attacker.write("member/7", json.dumps({
        "index": 7, "incarnation": "ab", "engine": "http://evil:1", "sidecar": "http://evil:2",
        "mac": "00" * 32,
    }))  # fmt: skip
    attacker.write("member/8", real)  # replayed under another index
    attacker.write("member/9", b"\xff not json")
    assert [m.index for m in sender.registered()] == [1, 2]
    assert sender.catch_up() is None  # nothing changed: no new generation for forgeries
    assert_serving(sender, sidecars, 2)
    # A genuine entry overwritten (or deleted) is restored by its sidecar within seconds.
    attacker.write("member/1", b"junk")
    assert [m.index for m in sender.registered()] == [2]
    deadline = time.monotonic() + 20
    while [m.index for m in sender.registered()] != [1, 2]:
        assert time.monotonic() < deadline, "the sidecar never re-registered"
        time.sleep(0.1)
    assert_serving(sender, sidecars, 3)


# -- a restarted sidecar and poisoned keys -----------------------------------------------------


@pytest.mark.parametrize("poisoned", ["latest announcement", "every pointer"])
def test_a_restarted_sidecar_is_not_wedged_by_poisoned_keys(poisoned: str) -> None:
    """The sidecar dies; before it comes back the attacker poisons the keys a restarted receiver
    reads first. It must start, ask to rejoin, and catch up on the latest version."""
    sender = SyncSender(HOST, 0, backend="gloo", timeout=TIMEOUT, key=KEY)
    try:
        first = Sidecar(sender.port, 1)
        (registered,) = sender.wait_registered(1, TIMEOUT)
        assert sender.send(update(1), header(1)).ok
        assert first.next_event() == ("update", 1)
        first.kill()
        attacker = Attacker(sender.port)
        attacker.write(f"announce/{attacker.next_seq() - 1}", b"\x00junk")
        if poisoned == "every pointer":
            attacker.write("seq", b"not a number")
            attacker.write("formed", json.dumps({"formed": 10**9, "mac": "00" * 32}))
        reborn = Sidecar(sender.port, 1)
        deadline = time.monotonic() + 20
        while [m.incarnation for m in sender.registered()] in ([], [registered.incarnation]):
            assert reborn.alive(), list(reborn.events.queue)
            assert time.monotonic() < deadline, "the restarted sidecar never registered"
            time.sleep(0.05)
        catch_up = sender.service_rejoin()
        assert catch_up is not None and catch_up.ok, catch_up
        assert reborn.next_event() == ("update", 1)
        assert_serving(sender, [reborn], 2)
        reborn.kill()
    finally:
        sender.close(wait=0)


# -- the store's address -----------------------------------------------------------------------


def _connects(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((address, port)) == 0


def test_the_store_listens_only_on_the_address_it_was_given() -> None:
    """127.0.0.2 is this machine too (all of 127/8 is loopback): a wildcard listener answers
    there, a socket bound to 127.0.0.1 does not. The same holds for a pod's address."""
    sender = SyncSender(HOST, 0, backend="gloo", timeout=TIMEOUT, key=KEY)
    try:
        assert _connects("127.0.0.1", sender.port)
        assert not _connects("127.0.0.2", sender.port)
    finally:
        sender.close(wait=0)
