"""The sync group's plumbing shared by both ends: backend choice, a standalone gloo/NCCL group
on a PrefixStore, fixed-size acknowledgements, and the results a sender reports."""

from __future__ import annotations

import contextlib
import secrets
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, BroadcastOptions

from lorarl.sync.buckets import SyncHeader
from lorarl.sync.errors import SyncError, SyncTransportError

STORE_PREFIX = "lorarl-sync"
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
# Forming a group waits for every member; one that died after it was counted must cost seconds.
DEFAULT_FORM_TIMEOUT_S = 30.0
ACK_BYTES = 1024
_ACK_HEAD = struct.Struct("<qBH")  # version, ok, message length
ACK_MAC_BYTES = 32  # the ack's HMAC (sync/auth.py) sits in the buffer's last bytes
_MAX_MESSAGE = ACK_BYTES - _ACK_HEAD.size - ACK_MAC_BYTES


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
class GroupState:
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
    """Build a standalone backend; blocks until all ranks of this generation rendezvous (at most
    `timeout`: the formation timeout, short, so a member that died after the trainer counted it
    costs seconds, not the operation timeout)."""
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


def ack_payload(version: int, ok: bool, message: str) -> bytes:
    """The signed part of an acknowledgement: version, outcome and message (truncated)."""
    raw = message.encode()[:_MAX_MESSAGE]
    return _ACK_HEAD.pack(version, int(ok), len(raw)) + raw


def encode_ack(
    version: int,
    ok: bool,
    message: str,
    device: torch.device,
    seal: Callable[[bytes], bytes] | None = None,
) -> torch.Tensor:
    """A fixed-size ack; `seal(payload)` gives its MAC (the sender's own slot goes unsealed)."""
    data = ack_payload(version, ok, message)
    mac = seal(data) if seal is not None else bytes(ACK_MAC_BYTES)
    if len(mac) != ACK_MAC_BYTES:
        raise ValueError(f"an ack MAC is {ACK_MAC_BYTES} bytes, got {len(mac)}")
    buf = torch.zeros(ACK_BYTES, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf[-ACK_MAC_BYTES:] = torch.frombuffer(bytearray(mac), dtype=torch.uint8)
    return buf.to(device)


def decode_ack(
    rank: int, buf: torch.Tensor, verify: Callable[[bytes, bytes], None] | None = None
) -> Ack:
    """Parse an ack; `verify(payload, mac)` raises ValueError for one not signed with the job's
    key, and such an ack counts as a failure whatever it claims: a forged "applied" must not
    let the trainer believe an engine serves weights it never received."""
    data = bytes(buf.cpu().tolist())
    version, ok, length = _ACK_HEAD.unpack_from(data)
    start = _ACK_HEAD.size
    length = min(length, _MAX_MESSAGE)
    message = data[start : start + length].decode(errors="replace")
    if verify is not None:
        try:
            verify(data[: start + length], data[-ACK_MAC_BYTES:])
        except ValueError as exc:
            return Ack(rank, version, False, f"acknowledgement refused: {exc}")
    return Ack(rank, version, bool(ok), message)


class Endpoint:
    """Store connection, control keys and the current group, shared by both sides.

    `ident` names this end in control marks: "0" for the sender, the replica index for a
    receiver. Rank and world size belong to a generation: membership changes between them."""

    def __init__(
        self,
        store: dist.Store,
        ident: str,
        backend: str,
        timeout: float,
        device: torch.device | str | None,
        form_timeout: float = DEFAULT_FORM_TIMEOUT_S,
    ):
        self.store = store
        self.ctl = dist.PrefixStore(f"{STORE_PREFIX}/ctl", store)
        self.ident, self.backend = ident, backend
        self.rank, self.world_size = -1, 0
        self.timeout = timedelta(seconds=timeout)
        self.form_timeout = timedelta(seconds=min(form_timeout, timeout))
        self.device = device_for(backend, device)
        self.group = GroupState()

    def form(self, generation: int, rank: int, world_size: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
        self.drop()
        try:
            pg = _new_backend(
                self.store, generation, rank, world_size, self.backend, self.form_timeout
            )
        except RuntimeError as exc:
            raise SyncTransportError(
                f"{self.ident}: could not form sync group generation {generation} of "
                f"{world_size} ranks: {exc}"
            ) from exc
        self.rank, self.world_size = rank, world_size
        self.group = GroupState(generation, pg)

    def drop(self) -> None:
        _shutdown(self.group.pg)
        self.group = GroupState()

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.timeout
        self.group.pg.broadcast([tensor], opts).wait()

    def mark(self, name: str) -> None:
        """Set this end's mark `name/<ident>` to a fresh random value (a request or a report)."""
        self.ctl.set(f"{name}/{self.ident}", secrets.token_hex(8))

    def marks(self, name: str, idents: Iterable[object]) -> dict[str, bytes]:
        """The current mark `name/<ident>` of each of `idents` (absent ones left out)."""
        out = {}
        for ident in idents:
            key = f"{name}/{ident}"
            if self.ctl.check([key]):
                out[key] = self.ctl.get(key)
        return out

    def all_gather_acks(self, mine: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        opts = AllgatherOptions()
        opts.timeout = self.timeout
        self.group.pg.allgather([out], [mine], opts).wait()
        return out
