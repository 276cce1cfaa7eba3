"""The sync wire: trainer rank 0 broadcasts buckets to every sidecar over its own process group.

Why not `init_process_group`: the trainer already owns the default group (FSDP), and a sidecar must
not join it. So the sender hosts a `TCPStore` and each side builds a gloo/NCCL backend object on a
`PrefixStore` directly — the same construction torch's `new_group` does internally, without
touching the global default group.

Control vs data: receivers wait for work on the *store* (an announcement key per operation), and
only the payload moves through the group. A process group has a fixed membership, so a sidecar
that restarts cannot re-enter the group its old incarnation was in. Instead every group has a
*generation*: its rendezvous keys live under `gen<g>/`. A restarted receiver reads the newest
formed generation, asks to rejoin (a store counter), and takes part only in announcements of a
newer generation. The sender notices the request, announces a new generation, every receiver
(healthy or restarted) builds the new group, and `service_rejoin()` re-sends the latest update so
the newcomer catches up at once. A collective failure (peer died) drops the group on both sides;
the next operation re-forms it. Re-forming waits until *all* `world_size` receivers join (gloo
worlds are fixed), bounded by `timeout`; the operator's job is to restart the missing pod.

Protocol of one operation n (announcement `ctl/announce/<n>` = {"op", "generation"}):
  sync:  [form group if new generation] -> broadcast header length (int64) -> header JSON
         (uint8) -> one broadcast per bucket (uint8) -> all_gather acks (fixed-size uint8).
  close: receivers bump `ctl/closed/<n>` and stop.
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lorarl.sync.buckets import Bucket, SyncHeader, pack, unpack_all
from lorarl.sync.errors import SyncClosed, SyncError, SyncTransportError

STORE_PREFIX = "lorarl-sync"
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
ACK_BYTES = 1024
_ACK_HEAD = struct.Struct("<qBH")  # version, ok, message length
_MAX_MESSAGE = ACK_BYTES - _ACK_HEAD.size


@dataclass(frozen=True)
class Ack:
    rank: int
    version: int
    ok: bool
    message: str = ""


@dataclass(frozen=True)
class TransferStats:
    bytes: int  # header + buckets, as broadcast
    seconds: float
    buckets: int


@dataclass(frozen=True)
class SyncResult:
    version: int
    generation: int
    acks: tuple[Ack, ...]
    stats: TransferStats

    @property
    def ok(self) -> bool:
        return all(a.ok and a.version == self.version for a in self.acks)

    @property
    def failed(self) -> list[Ack]:
        return [a for a in self.acks if not (a.ok and a.version == self.version)]


class Received(NamedTuple):
    header: SyncHeader
    tensors: dict[str, torch.Tensor]


@dataclass
class _GroupState:
    generation: int = -1
    pg: Any = None


BACKENDS = ("gloo", "nccl")
BACKEND_ENV = "LORARL_SYNC_BACKEND"


def backend_from_env(env: Mapping[str, str]) -> str:
    """The backend the plan chose for this job's sync group (`LORARL_SYNC_BACKEND`). Both ends
    of one group must agree, so it is never guessed from the local hardware: a sidecar without a
    GPU next to a trainer with one would pick differently."""
    backend = env.get(BACKEND_ENV)
    if backend not in BACKENDS:
        raise SyncError(f"{BACKEND_ENV} must be one of {', '.join(BACKENDS)} (got {backend!r})")
    return backend


def device_for(backend: str, device: torch.device | str | None = None) -> torch.device:
    """Where the group's buffers live: gloo moves CPU tensors, NCCL only CUDA tensors (an NCCL
    group rejects a CPU tensor). With gloo the trainer's CUDA tensors are staged through host
    memory when they are packed."""
    if backend not in BACKENDS:
        raise SyncError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if device is not None:
        return torch.device(device)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _new_backend(
    store: dist.Store,
    generation: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout: timedelta,
) -> Any:
    """Build a standalone backend; blocks until all ranks of this generation rendezvous."""
    prefix = dist.PrefixStore(f"{STORE_PREFIX}/gen{generation}", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise SyncError("backend 'nccl' requested but this torch build has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        return dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    raise SyncError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def _shutdown(pg: Any) -> None:
    """Close sockets now so peers see a closed connection instead of waiting for a timeout."""
    if pg is None:
        return
    with contextlib.suppress(RuntimeError, AttributeError):
        pg.shutdown()


def encode_ack(version: int, ok: bool, message: str, device: torch.device) -> torch.Tensor:
    raw = message.encode()[:_MAX_MESSAGE]
    data = _ACK_HEAD.pack(version, int(ok), len(raw)) + raw
    buf = torch.zeros(ACK_BYTES, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.to(device)


def decode_ack(rank: int, buf: torch.Tensor) -> Ack:
    data = bytes(buf.cpu().tolist())
    version, ok, length = _ACK_HEAD.unpack_from(data)
    start = _ACK_HEAD.size
    return Ack(rank, version, bool(ok), data[start : start + length].decode(errors="replace"))


class _Endpoint:
    """Store connection, control keys and the current group, shared by both sides."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        backend: str,
        timeout: float,
        device: torch.device | str | None,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
        self.store = store
        self.ctl = dist.PrefixStore(f"{STORE_PREFIX}/ctl", store)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timedelta(seconds=timeout)
        self.device = device_for(backend, device)
        self.group = _GroupState()

    def form(self, generation: int) -> None:
        self.drop()
        try:
            pg = _new_backend(
                self.store, generation, self.rank, self.world_size, self.backend, self.timeout
            )
        except RuntimeError as exc:
            raise SyncTransportError(
                f"rank {self.rank}: could not form sync group generation {generation} of "
                f"{self.world_size} ranks: {exc}"
            ) from exc
        self.group = _GroupState(generation, pg)

    def drop(self) -> None:
        _shutdown(self.group.pg)
        self.group = _GroupState()

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.group.pg.broadcast(tensor, 0).wait()

    def all_gather_acks(self, mine: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.group.pg.allgather([out], [mine]).wait()
        return out

    def get_int(self, key: str, default: int) -> int:
        return int(self.ctl.get(key)) if self.ctl.check([key]) else default


class SyncSender:
    """Trainer rank 0: hosts the store (port 0 picks a free port) and broadcasts updates."""

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        backend: str,
        timeout: float = 120.0,
        device: torch.device | str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        device_for(backend, device or "cpu")  # a bad backend fails before the store binds
        store = dist.TCPStore(
            host, port, None, True, timedelta(seconds=timeout), wait_for_workers=False
        )
        self._ep = _Endpoint(store, 0, world_size, backend, timeout, device)
        self.bucket_bytes = bucket_bytes
        self._seq = -1
        self._next_generation = 0
        self._rejoin_seen = 0
        self._latest: tuple[SyncHeader, list[Bucket]] | None = None

    @property
    def port(self) -> int:
        return int(self._ep.store.port)

    @property
    def generation(self) -> int:
        return self._ep.group.generation

    def rejoin_requested(self) -> bool:
        return int(self._ep.ctl.add("rejoin", 0)) != self._rejoin_seen

    def send(self, tensors: dict[str, torch.Tensor], header: SyncHeader) -> SyncResult:
        """Pack, broadcast and collect one ack per receiver (rank order 1..N)."""
        buckets = pack(tensors, self.bucket_bytes, device=self._ep.device)
        return self._send_packed(header.with_buckets(buckets), buckets)

    def service_rejoin(self) -> SyncResult | None:
        """If a restarted receiver asked to rejoin, re-form the group and re-send the latest."""
        if self._latest is None or not self.rejoin_requested():
            return None
        return self._send_packed(*self._latest)

    def close(self, wait: float = 5.0) -> None:
        """Tell receivers to stop; wait (bounded) until they read it: the store dies with us."""
        ep = self._ep
        seq = self._announce({"op": "close", "generation": ep.group.generation})
        ep.drop()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if int(ep.ctl.add(f"closed/{seq}", 0)) >= ep.world_size - 1:
                break
            time.sleep(0.01)

    def _announce(self, message: dict[str, Any]) -> int:
        self._seq += 1
        self._ep.ctl.set(f"announce/{self._seq}", json.dumps(message))
        self._ep.ctl.set("seq", str(self._seq))
        return self._seq

    def _send_packed(self, header: SyncHeader, buckets: list[Bucket]) -> SyncResult:
        ep = self._ep
        start = time.perf_counter()
        need_group = ep.group.pg is None or self.rejoin_requested()
        if need_group:
            generation = self._next_generation
            self._next_generation += 1
        else:
            generation = ep.group.generation
        self._announce({"op": "sync", "generation": generation})
        if need_group:
            ep.form(generation)
            ep.ctl.set("formed", str(generation))
            # Read after forming: every request made until now came from a rank that is in the
            # new group (formation needs all ranks), so it is served.
            self._rejoin_seen = int(ep.ctl.add("rejoin", 0))
        header_bytes = header.to_bytes()
        try:
            ep.broadcast(torch.tensor([len(header_bytes)], dtype=torch.int64, device=ep.device))
            ep.broadcast(torch.frombuffer(bytearray(header_bytes), dtype=torch.uint8).to(ep.device))
            for bucket in buckets:
                ep.broadcast(bucket.buffer)
            mine = encode_ack(header.version, True, "", ep.device)
            gathered = ep.all_gather_acks(mine)
        except RuntimeError as exc:
            ep.drop()
            raise SyncTransportError(
                f"sync v{header.version} failed in generation {generation}: {exc}"
            ) from exc
        self._latest = (header, buckets)
        stats = TransferStats(
            bytes=8 + len(header_bytes) + sum(b.spec.nbytes for b in buckets),
            seconds=time.perf_counter() - start,
            buckets=len(buckets),
        )
        acks = tuple(decode_ack(r, gathered[r]) for r in range(1, ep.world_size))
        return SyncResult(header.version, generation, acks, stats)


class SyncReceiver:
    """A sidecar: waits for announcements on the sender's store and receives updates."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout: float = 120.0,
        device: torch.device | str | None = None,
        poll_interval: float = 0.05,
    ):
        if rank == 0:
            raise ValueError("rank 0 is the sender; receivers are ranks 1..world_size-1")
        device_for(backend, device or "cpu")
        try:
            store = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout))
        except RuntimeError as exc:
            raise SyncTransportError(f"cannot reach sync store {host}:{port}: {exc}") from exc
        self._ep = _Endpoint(store, rank, world_size, backend, timeout, device)
        self.poll_interval = poll_interval
        self._pending_version: int | None = None
        self.last_stats: TransferStats | None = None
        # Generations formed before we (re)started already hold our rank's old incarnation.
        formed = self._ep.get_int("formed", -1)
        self._min_generation = formed + 1
        self._next_seq = max(self._ep.get_int("seq", 0), 0)
        if formed >= 0:
            self._ep.ctl.add("rejoin", 1)

    @property
    def generation(self) -> int:
        return self._ep.group.generation

    def recv(self, timeout: float | None = None) -> Received:
        """Block until the next update; raises SyncClosed when the sender closes."""
        if self._pending_version is not None:
            raise SyncError(f"ack() version {self._pending_version} before receiving the next one")
        ep = self._ep
        while True:
            message = self._wait_announcement(timeout)
            if message["op"] == "close":
                ep.drop()
                ep.ctl.add(f"closed/{self._next_seq - 1}", 1)
                raise SyncClosed("sender closed the sync channel")
            generation = int(message["generation"])
            if generation < self._min_generation:
                continue  # formed before we joined; our rank there is a dead incarnation
            if generation != ep.group.generation:
                ep.form(generation)
            return self._receive_update()

    def ack(self, version: int, ok: bool = True, message: str = "") -> None:
        """Report the outcome of the last update; the sender's send() returns once all ack."""
        if self._pending_version is None:
            raise SyncError("ack() without a received update")
        ep = self._ep
        try:
            ep.all_gather_acks(encode_ack(version, ok, message, ep.device))
        except RuntimeError as exc:
            self._fail(exc)
        finally:
            self._pending_version = None

    def close(self) -> None:
        self._ep.drop()

    def _receive_update(self) -> Received:
        ep = self._ep
        start = time.perf_counter()
        try:
            length = torch.zeros(1, dtype=torch.int64, device=ep.device)
            ep.broadcast(length)
            raw = torch.empty(int(length.item()), dtype=torch.uint8, device=ep.device)
            ep.broadcast(raw)
            header = SyncHeader.from_bytes(bytes(raw.cpu().numpy()))
            buffers = []
            for spec in header.buckets:
                buf = torch.empty(spec.nbytes, dtype=torch.uint8, device=ep.device)
                ep.broadcast(buf)
                buffers.append(buf)
        except RuntimeError as exc:
            self._fail(exc)
        self.last_stats = TransferStats(
            bytes=8 + raw.numel() + sum(b.numel() for b in buffers),
            seconds=time.perf_counter() - start,
            buckets=len(buffers),
        )
        self._pending_version = header.version
        return Received(header, unpack_all(buffers, header))

    def _fail(self, exc: BaseException) -> None:
        """Leave the broken group and ask the sender for a fresh one."""
        generation = self._ep.group.generation
        self._min_generation = generation + 1
        self._ep.drop()
        self._pending_version = None
        with contextlib.suppress(RuntimeError):
            self._ep.ctl.add("rejoin", 1)
        raise SyncTransportError(
            f"rank {self._ep.rank}: sync group generation {generation} failed: {exc}"
        ) from exc

    def _wait_announcement(self, timeout: float | None) -> dict[str, Any]:
        key = f"announce/{self._next_seq}"
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while True:
            try:
                if self._ep.ctl.check([key]):
                    message = json.loads(self._ep.ctl.get(key))
                    self._next_seq += 1
                    return message
            except RuntimeError as exc:
                raise SyncTransportError(f"sync store unreachable: {exc}") from exc
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no sync announcement within {timeout} s")
            time.sleep(delay)
            delay = min(delay * 2, self.poll_interval)
