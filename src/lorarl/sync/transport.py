"""The sync wire: trainer rank 0 broadcasts buckets to every sidecar over its own process group.

Why not `init_process_group`: the trainer already owns the default group (FSDP), and a sidecar must
not join it. So the sender hosts a `TCPStore` and each side builds a gloo/NCCL backend object on a
`PrefixStore` directly — the same construction torch's `new_group` does internally, without
touching the global default group.

Control vs data: receivers wait for work on the *store* (an announcement key per operation), and
only the payload moves through the group. A process group has a fixed membership, so a sidecar
that restarts cannot re-enter the group its old incarnation was in. Instead every group has a
*generation*: its rendezvous keys live under `gen<g>/`. A restarted receiver reads the newest
formed generation, asks to rejoin (a fresh mark under `rejoin/<rank>`), and takes part only in
announcements of a
newer generation. The sender notices the request, announces a new generation, every receiver
(healthy or restarted) builds the new group, and `service_rejoin()` re-sends the latest update so
the newcomer catches up at once. A collective failure (peer died) drops the group on both sides;
the next operation re-forms it. Re-forming waits until *all* `world_size` receivers join (gloo
worlds are fixed), bounded by `timeout`; the operator's job is to restart the missing pod.

Trust: the store has no access control, so every announcement, control value and header is
signed with the job's key (`sync/auth.py`) and every bucket's SHA-256 is in the signed header. A
store value that does not verify is logged and ignored (the genuine one may still come); a header
that does not verify makes the receiver leave the group (it cannot follow the rest of the
operation) and report why under `ctl/nack/<n>/<rank>`; a signed header whose layout or digests do
not fit its buckets is nacked in-band. Nothing a peer sends crashes a receiver.

Protocol of one operation n (announcement `ctl/announce/<n>` = signed {"op", "generation", "seq"}):
  sync:  [form group if new generation] -> broadcast header length (int64) -> MAC + header JSON
         (uint8) -> one broadcast per bucket (uint8) -> all_gather acks (fixed-size uint8).
  close: receivers set `ctl/closed/<n>/<rank>` and stop.

Control marks (rejoin requests, close reports) are set, never incremented with `add`: the store
server drops the connection of a client that increments a non-number, so a counter anyone can
overwrite would cut the trainer or a sidecar off the store. The receiving end is `receiver.py`.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from lorarl.sync.auth import Signer, bucket_digest, resolve_key
from lorarl.sync.buckets import Bucket, SyncHeader, pack
from lorarl.sync.errors import SyncTransportError
from lorarl.sync.group import (
    DEFAULT_BUCKET_BYTES,
    Endpoint,
    Received,
    SyncResult,
    TransferStats,
    backend_from_env,
    decode_ack,
    device_for,
    encode_ack,
)
from lorarl.sync.receiver import MAX_HEADER_BYTES, MAX_NACK_CHARS, SyncReceiver
from lorarl.sync.store import host_store

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "MAX_HEADER_BYTES",
    "Received",
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
        world_size: int,
        backend: str,
        timeout: float = 120.0,
        device: torch.device | str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        key: str | bytes | None = None,
    ):
        device_for(backend, device or "cpu")  # a bad backend or key fails before the store binds
        self._signer = Signer(resolve_key(key))
        store = host_store(host, port, timeout)
        self._ep = Endpoint(store, 0, world_size, backend, timeout, device)
        self.bucket_bytes = bucket_bytes
        self._seq = -1
        self._next_generation = 0
        self._rejoin_seen: dict[str, bytes] = {}
        self._latest: tuple[SyncHeader, list[Bucket]] | None = None

    @property
    def port(self) -> int:
        return int(self._ep.store.port)

    @property
    def generation(self) -> int:
        return self._ep.group.generation

    def rejoin_requested(self) -> bool:
        return self._rejoin_marks() != self._rejoin_seen

    def _rejoin_marks(self) -> dict[str, bytes]:
        """Each receiver's latest rejoin mark. Marks are set, never `add`ed: the store server
        drops the connection of a client that increments a non-number, so a counter anyone can
        overwrite would cut the trainer off its own store."""
        return self._ep.marks("rejoin")

    def send(self, tensors: dict[str, torch.Tensor], header: SyncHeader) -> SyncResult:
        """Pack, broadcast and collect one ack per receiver (rank order 1..N)."""
        buckets = [
            Bucket(b.spec.model_copy(update={"sha256": bucket_digest(b.buffer)}), b.buffer)
            for b in pack(tensors, self.bucket_bytes, device=self._ep.device)
        ]
        return self._send_packed(header.with_buckets(buckets), buckets)

    def service_rejoin(self) -> SyncResult | None:
        """If a restarted receiver asked to rejoin, re-form the group and re-send the latest."""
        if self._latest is None or not self.rejoin_requested():
            return None
        return self._send_packed(*self._latest)

    def close(self, wait: float = 5.0) -> None:
        """Tell receivers to stop; wait (bounded) until they read it: the store dies with us."""
        ep = self._ep
        seq = self._announce("close", ep.group.generation)
        ep.drop()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if len(ep.marks(f"closed/{seq}")) >= ep.world_size - 1:
                break
            time.sleep(0.01)

    def _announce(self, op: str, generation: int) -> int:
        self._seq += 1
        self._ep.ctl.set(
            f"announce/{self._seq}", self._signer.announcement(op, generation, self._seq)
        )
        self._ep.ctl.set("seq", self._signer.value("seq", self._seq))
        return self._seq

    def _nacks(self, seq: int) -> str:
        """What receivers that left operation `seq` said (diagnostics only: not authenticated)."""
        said = []
        for rank in range(1, self._ep.world_size):
            with contextlib.suppress(RuntimeError):
                if self._ep.ctl.check([f"nack/{seq}/{rank}"]):
                    reason = self._ep.ctl.get(f"nack/{seq}/{rank}")[:MAX_NACK_CHARS]
                    said.append(f"sidecar {rank}: {reason.decode(errors='replace')}")
        return f" ({'; '.join(said)})" if said else ""

    def _send_packed(self, header: SyncHeader, buckets: list[Bucket]) -> SyncResult:
        ep = self._ep
        start = time.perf_counter()
        need_group = ep.group.pg is None or self.rejoin_requested()
        if need_group:
            generation = self._next_generation
            self._next_generation += 1
        else:
            generation = ep.group.generation
        seq = self._announce("sync", generation)
        if need_group:
            ep.form(generation)
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
        self._latest = (header, buckets)
        stats = TransferStats(
            bytes=8 + len(sealed) + sum(b.spec.nbytes for b in buckets),
            seconds=time.perf_counter() - start,
            buckets=len(buckets),
        )
        acks = tuple(decode_ack(r, gathered[r]) for r in range(1, ep.world_size))
        return SyncResult(header.version, generation, acks, stats)
