"""The sync wire: trainer rank 0 broadcasts buckets to every sidecar over its own process group.

Why not `init_process_group`: the trainer already owns the default group (FSDP), and a sidecar must
not join it. So the sender hosts a `TCPStore` and each side builds a gloo/NCCL backend object on a
`PrefixStore` directly — the same construction torch's `new_group` does internally, without
touching the global default group.

Control vs data: receivers wait for work on the *store* (an announcement key per operation), and
only the payload moves through the group. Membership is live (docs/architecture.md#live-membership):
each receiver registers at `ctl/member/<index>` with a fresh incarnation, and every group has a
*generation* whose rendezvous keys live under `gen<g>/` and whose signed announcement lists its
members (`index:incarnation`, rank = position + 1). The sender forms a new generation whenever the
members it is given differ from the current group's, or a receiver whose group broke asks to
rejoin (a fresh mark under `rejoin/<index>`); `catch_up()` then re-sends the latest update so a
newcomer holds it at once. A collective failure (peer died) drops the group on both sides; the next
operation re-forms it. Forming waits for every listed member, bounded by the formation timeout.

Trust: the store has no access control, so every announcement, control value and header is
signed with the job's key (`sync/auth.py`) and every bucket's SHA-256 is in the signed header. A
store value that does not verify is logged and ignored (the genuine one may still come); a header
that does not verify makes the receiver leave the group (it cannot follow the rest of the
operation) and report why under `ctl/nack/<n>/<index>`; a signed header whose layout or digests do
not fit its buckets is nacked in-band. Nothing a peer sends crashes a receiver.

Protocol of one operation n (`ctl/announce/<n>` = signed {"op", "generation", "seq", "members"}):
  sync:  [form group if new generation] -> broadcast header length (int64) -> MAC + header JSON
         (uint8) -> one broadcast per bucket (uint8) -> all_gather acks (fixed-size uint8).
  close: receivers set `ctl/closed/<n>/<index>` and stop.

Control marks (rejoin requests, close reports) are set, never incremented with `add`: the store
server drops the connection of a client that increments a non-number, so a counter anyone can
overwrite would cut the trainer or a sidecar off the store. The receiving end is `receiver.py`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from functools import partial

import torch

from lorarl.sync.auth import (
    MAX_MEMBERS,
    BadMessage,
    Registration,
    Signer,
    bucket_digest,
    resolve_key,
)
from lorarl.sync.buckets import Bucket, SyncHeader, pack
from lorarl.sync.errors import SyncTransportError
from lorarl.sync.group import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_FORM_TIMEOUT_S,
    Endpoint,
    Received,
    SyncResult,
    TransferStats,
    backend_from_env,
    decode_ack,
    device_for,
    encode_ack,
)
from lorarl.sync.receiver import (
    MAX_HEADER_BYTES,
    MAX_NACK_CHARS,
    SCAN_AHEAD,
    SyncReceiver,
    member_key,
)
from lorarl.sync.store import host_store

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "MAX_HEADER_BYTES",
    "Received",
    "Registration",
    "SyncReceiver",
    "SyncResult",
    "SyncSender",
    "backend_from_env",
    "device_for",
]

log = logging.getLogger("lorarl.sync")


class SyncSender:
    """Trainer rank 0: hosts the store (port 0 picks a free port) and broadcasts updates.

    `key` is the job's sync key; None reads `LORARL_SYNC_KEY` (a missing key is an error)."""

    def __init__(
        self,
        host: str,
        port: int,
        backend: str,
        timeout: float = 120.0,
        device: torch.device | str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        key: str | bytes | None = None,
        form_timeout: float = DEFAULT_FORM_TIMEOUT_S,
    ):
        device_for(backend, device or "cpu")  # a bad backend or key fails before the store binds
        self._signer = Signer(resolve_key(key))
        self._store = host_store(host, port, timeout)  # the TCPStore (the Endpoint takes any Store)
        self._ep = Endpoint(self._store, "0", backend, timeout, device, form_timeout)
        self.bucket_bytes = bucket_bytes
        self._seq = -1
        self._next_generation = 0
        self._members: tuple[Registration, ...] = ()  # the current group's receivers, rank order
        self._rejoin_seen: dict[str, bytes] = {}
        self._latest: tuple[SyncHeader, list[Bucket]] | None = None
        self._scan_end = SCAN_AHEAD  # registrations are read at indices [0, _scan_end)

    @property
    def port(self) -> int:
        return int(self._store.port)

    @property
    def generation(self) -> int:
        return self._ep.group.generation

    @property
    def members(self) -> tuple[Registration, ...]:
        """The receivers of the current group (empty before the first one forms)."""
        return self._members if self._ep.group.pg is not None else ()

    @property
    def latest_version(self) -> int | None:
        return None if self._latest is None else self._latest[0].version

    def registered(self) -> list[Registration]:
        """Every receiver registered now, by replica index. A value that does not verify is
        ignored (logged once per change): only holders of the job key can join."""
        found: list[Registration] = []
        for index in range(min(self._scan_end, MAX_MEMBERS)):
            key = member_key(index)
            if not self._ep.ctl.check([key]):
                continue
            raw = self._ep.ctl.get(key)
            try:
                found.append(self._signer.open_registration(raw, index))
            except BadMessage as exc:
                log.warning("ignored sync registration %d: %s", index, exc)
        top = max((m.index for m in found), default=-1)
        self._scan_end = max(self._scan_end, top + 1 + SCAN_AHEAD)
        return found

    def wait_registered(self, count: int, timeout: float) -> list[Registration]:
        """Registrations once `count` receivers are in (or `timeout` passed: whoever is in)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.registered()
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def rejoin_requested(self) -> bool:
        return self._rejoin_marks() != self._rejoin_seen

    def _rejoin_marks(self) -> dict[str, bytes]:
        """Each member's latest rejoin mark. Marks are set, never `add`ed: the store server
        drops the connection of a client that increments a non-number, so a counter anyone can
        overwrite would cut the trainer off its own store."""
        return self._ep.marks("rejoin", (m.index for m in self._members))

    def send(
        self,
        tensors: dict[str, torch.Tensor],
        header: SyncHeader,
        members: Sequence[Registration] | None = None,
    ) -> SyncResult:
        """Pack, broadcast to `members` (default: every registered receiver) and collect one
        ack per member, in rank order. A membership different from the current group's forms
        a new generation first. With no member, the update is only kept for `catch_up`."""
        buckets = [
            Bucket(b.spec.model_copy(update={"sha256": bucket_digest(b.buffer)}), b.buffer)
            for b in pack(tensors, self.bucket_bytes, device=self._ep.device)
        ]
        return self._send_packed(header.with_buckets(buckets), buckets, members)

    def catch_up(
        self, members: Sequence[Registration] | None = None, force: bool = False
    ) -> SyncResult | None:
        """Re-send the latest update when the membership changed (a receiver joined, left or
        restarted), a receiver asked to rejoin, or `force`; None when nothing had to move."""
        if self._latest is None:
            return None
        members = tuple(self.registered() if members is None else members)
        if not force and members == self.members and not self.rejoin_requested():
            return None
        return self._send_packed(*self._latest, members)

    def service_rejoin(self) -> SyncResult | None:
        """Bring every registered receiver (restarted ones included) to the latest update."""
        return self.catch_up()

    def close(self, wait: float = 5.0) -> None:
        """Tell receivers to stop; wait (bounded) until they read it: the store dies with us."""
        ep = self._ep
        members = self._members
        seq = self._announce("close", ep.group.generation, ())
        ep.drop()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if len(ep.marks(f"closed/{seq}", (m.index for m in members))) >= len(members):
                break
            time.sleep(0.01)

    def _announce(self, op: str, generation: int, members: tuple[Registration, ...]) -> int:
        self._seq += 1
        tokens = tuple(m.token for m in members)
        self._ep.ctl.set(
            f"announce/{self._seq}", self._signer.announcement(op, generation, self._seq, tokens)
        )
        self._ep.ctl.set("seq", self._signer.value("seq", self._seq))
        return self._seq

    def _nacks(self, seq: int) -> str:
        """What receivers that left operation `seq` said (diagnostics only: not authenticated)."""
        said = []
        for member in self._members:
            with contextlib.suppress(RuntimeError):
                key = f"nack/{seq}/{member.index}"
                if self._ep.ctl.check([key]):
                    reason = self._ep.ctl.get(key)[:MAX_NACK_CHARS]
                    said.append(f"sidecar {member.index}: {reason.decode(errors='replace')}")
        return f" ({'; '.join(said)})" if said else ""

    def _send_packed(
        self,
        header: SyncHeader,
        buckets: list[Bucket],
        members: Sequence[Registration] | None,
    ) -> SyncResult:
        ep = self._ep
        start = time.perf_counter()
        members = tuple(self.registered() if members is None else members)
        if len({m.index for m in members}) != len(members):
            raise ValueError(f"members repeat a replica index: {[m.index for m in members]}")
        self._latest = (header, buckets)
        if not members:
            ep.drop()
            self._members, self._rejoin_seen = (), {}
            return SyncResult(header.version, -1, (), TransferStats(0, 0.0, 0))
        need_group = ep.group.pg is None or members != self._members or self.rejoin_requested()
        if need_group:
            generation = self._next_generation
            self._next_generation += 1
        else:
            generation = ep.group.generation
        seq = self._announce("sync", generation, members)
        if need_group:
            self._members = members
            ep.form(generation, 0, 1 + len(members))
            ep.ctl.set("formed", self._signer.value("formed", generation))
            # Read after forming: every request made until now came from a rank that is in the
            # new group (formation needs all ranks), so it is served.
            self._rejoin_seen = self._rejoin_marks()
        sealed = self._signer.seal_header(header.to_bytes(), generation, seq)
        try:
            ep.broadcast(torch.tensor([len(sealed)], dtype=torch.int64, device=ep.device))
            ep.broadcast(torch.frombuffer(bytearray(sealed), dtype=torch.uint8).to(ep.device))
            for bucket in buckets:
                ep.broadcast(bucket.buffer)
            mine = encode_ack(header.version, True, "", ep.device)
            gathered = ep.all_gather_acks(mine)
        except RuntimeError as exc:
            ep.drop()
            raise SyncTransportError(
                f"sync v{header.version} failed in generation {generation}: {exc}{self._nacks(seq)}"
            ) from exc
        stats = TransferStats(
            bytes=8 + len(sealed) + sum(b.spec.nbytes for b in buckets),
            seconds=time.perf_counter() - start,
            buckets=len(buckets),
        )
        acks = tuple(
            decode_ack(
                m.index, gathered[rank], partial(self._signer.check_ack, m.index, generation, seq)
            )
            for rank, m in enumerate(members, start=1)
        )
        return SyncResult(header.version, generation, acks, stats)
