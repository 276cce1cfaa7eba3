"""The receiving end of the sync wire (a sidecar); the protocol is described in `transport`.

Nothing read from the store or the group is trusted before it verifies: an announcement that
does not is ignored, a header that does not makes the receiver leave the operation and say why,
and a signed update whose layout or bytes do not fit is nacked. None of it raises anything but a
`SyncError`, so a sidecar keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn

import torch
from pydantic import ValidationError

from lorarl.sync.auth import Announcement, BadMessage, Signer, bucket_digest, resolve_key
from lorarl.sync.buckets import SyncHeader, check_layout, unpack_all
from lorarl.sync.errors import (
    SyncClosed,
    SyncError,
    SyncRefused,
    SyncTransportError,
    UpdateValidationError,
)
from lorarl.sync.group import Endpoint, Received, TransferStats, device_for, encode_ack
from lorarl.sync.store import connect_store

log = logging.getLogger("lorarl.sync")

MAX_HEADER_BYTES = 16 * 1024 * 1024  # ~100x a 70B model's all-linear LoRA header
MAX_NACK_CHARS = 300
MAX_SCAN = 1_000_000  # announcements a receiver walks when the store's pointers are poisoned


class SyncReceiver:
    """A sidecar: waits for announcements on the sender's store and receives updates.

    `key` is the job's sync key; None reads `LORARL_SYNC_KEY` (a missing key is an error)."""

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
        key: str | bytes | None = None,
    ):
        if rank == 0:
            raise ValueError("rank 0 is the sender; receivers are ranks 1..world_size-1")
        device_for(backend, device or "cpu")
        self._signer = Signer(resolve_key(key))
        store = connect_store(host, port, timeout)
        self._ep = Endpoint(store, rank, world_size, backend, timeout, device)
        self.poll_interval = poll_interval
        self._pending_version: int | None = None
        self._ignored: dict[int, bytes] = {}  # announcement seq -> the bad value last logged
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="lorarl-sync-sha256")
        self.last_stats: TransferStats | None = None
        try:
            formed, seq = self._read_value("formed"), self._read_value("seq")
            rejoin = formed >= 0
        except BadMessage as exc:
            log.warning("sync store pointers do not verify (%s); scanning announcements", exc)
            formed, seq = self._scan()
            rejoin = True  # whatever was formed, a fresh generation is safe
        # Generations formed before we (re)started already hold our rank's old incarnation.
        self._min_generation = formed + 1
        self._next_seq = max(seq, 0)
        if rejoin:
            self._ep.mark("rejoin")

    @property
    def generation(self) -> int:
        return self._ep.group.generation

    def recv(self, timeout: float | None = None) -> Received:
        """Block until the next update; raises SyncClosed when the sender closes, SyncRefused
        when an update was refused (already reported to the sender; call recv() again)."""
        if self._pending_version is not None:
            raise SyncError(f"ack() version {self._pending_version} before receiving the next one")
        ep = self._ep
        while True:
            op, generation, seq = self._wait_announcement(timeout)
            if op == "close":
                ep.drop()
                with contextlib.suppress(RuntimeError):  # the sender may be gone already
                    ep.mark(f"closed/{seq}")
                raise SyncClosed("sender closed the sync channel")
            if generation < self._min_generation:
                continue  # formed before we joined; our rank there is a dead incarnation
            if generation != ep.group.generation:
                ep.form(generation)
            return self._receive_update(generation, seq)

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
        self._hasher.shutdown(wait=False)

    def _receive_update(self, generation: int, seq: int) -> Received:
        ep = self._ep
        start = time.perf_counter()
        problem = None
        try:
            length = torch.zeros(1, dtype=torch.int64, device=ep.device)
            ep.broadcast(length)
            size = int(length.item())
            if not 0 < size <= MAX_HEADER_BYTES:
                self._leave(generation, seq, f"header length {size} outside 1..{MAX_HEADER_BYTES}")
            raw = torch.empty(size, dtype=torch.uint8, device=ep.device)
            ep.broadcast(raw)
            header = self._open_header(bytes(raw.cpu().numpy()), generation, seq)
            try:
                check_layout(header)
            except UpdateValidationError as exc:
                problem = str(exc)
            buffers, digests = [], []
            for spec in header.buckets:  # sizes are signed: received even when refused, so
                buf = torch.empty(spec.nbytes, dtype=torch.uint8, device=ep.device)  # the
                ep.broadcast(buf)  # group stays in step and the refusal goes back as a nack
                buffers.append(buf)
                # Hashed while the next bucket arrives (hashlib and gloo both release the GIL).
                digests.append(self._hasher.submit(bucket_digest, buf))
        except RuntimeError as exc:
            self._fail(exc)
        self.last_stats = TransferStats(
            bytes=8 + raw.numel() + sum(b.numel() for b in buffers),
            seconds=time.perf_counter() - start,
            buckets=len(buffers),
        )
        self._pending_version = header.version
        tensors = {}
        if problem is None:
            problem = _digest_problem(header, [d.result() for d in digests])
        if problem is None:
            try:
                tensors = unpack_all(buffers, header)
            except UpdateValidationError as exc:
                problem = str(exc)
        if problem is not None:
            log.error("refused update v%d: %s", header.version, problem)
            self.ack(header.version, ok=False, message=problem[:900])
            raise SyncRefused(f"v{header.version}: {problem}")
        return Received(header, tensors)

    def _open_header(self, data: bytes, generation: int, seq: int) -> SyncHeader:
        try:
            return SyncHeader.from_bytes(self._signer.open_header(data, generation, seq))
        except BadMessage as exc:
            reason = str(exc)
        except ValidationError as exc:  # signed but unparseable: the bucket sizes are unknown
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "header"
            reason = f"header does not parse: {where}: {first['msg']}"
        self._leave(generation, seq, reason)

    def _leave(self, generation: int, seq: int, reason: str) -> NoReturn:
        """Refuse an operation we cannot follow to its end: say why in the store, leave the
        group (peers see a closed connection at once) and ask for a new generation."""
        log.error("refused sync operation %d: %s", seq, reason)
        with contextlib.suppress(RuntimeError):
            self._ep.ctl.set(f"nack/{seq}/{self._ep.rank}", reason[:MAX_NACK_CHARS])
        self._min_generation = max(self._min_generation, generation + 1)
        self._ep.drop()
        with contextlib.suppress(RuntimeError):
            self._ep.mark("rejoin")
        raise SyncRefused(f"sync operation {seq}: {reason}")

    def _fail(self, exc: BaseException) -> NoReturn:
        """Leave the broken group and ask the sender for a fresh one."""
        generation = self._ep.group.generation
        self._min_generation = generation + 1
        self._ep.drop()
        self._pending_version = None
        with contextlib.suppress(RuntimeError):
            self._ep.mark("rejoin")
        raise SyncTransportError(
            f"rank {self._ep.rank}: sync group generation {generation} failed: {exc}"
        ) from exc

    def _read_value(self, name: str) -> int:
        """A signed control value; -1 when absent (nothing announced or formed yet)."""
        ctl = self._ep.ctl
        return self._signer.open_value(name, ctl.get(name)) if ctl.check([name]) else -1

    def _announcement(self, seq: int) -> Announcement | None:
        """The verified announcement at `seq`, None if absent; BadMessage if it does not verify."""
        key = f"announce/{seq}"
        if not self._ep.ctl.check([key]):
            return None
        return self._signer.open_announcement(self._ep.ctl.get(key), seq)

    def _scan(self) -> tuple[int, int]:
        """(newest verified generation, the seq after the last announcement), read from the
        announcements themselves when the pointers to them are poisoned: the receiver then
        waits only for operations announced after it started (its rejoin request makes one)."""
        newest_generation, after_last = -1, 0
        for seq in range(MAX_SCAN):
            try:
                found = self._announcement(seq)
            except BadMessage:
                after_last = seq + 1
                continue
            if found is None:
                if not self._ep.ctl.check([f"announce/{seq + 1}"]):
                    break
                continue
            newest_generation = max(newest_generation, found.generation)
            after_last = seq + 1
        return newest_generation, after_last

    def _wait_announcement(self, timeout: float | None) -> Announcement:
        """The next verified announcement. One that does not verify is logged and ignored: the
        sender's own write may still replace it, and once a verified later one exists, it is
        skipped (a restarted receiver is never wedged on a poisoned key)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while True:
            seq = self._next_seq
            try:
                found = self._announcement(seq)
            except BadMessage as exc:
                found = None
                self._log_ignored(seq, exc)
                with contextlib.suppress(BadMessage, RuntimeError):
                    if self._announcement(seq + 1) is not None:
                        self._next_seq += 1
                        continue
            except RuntimeError as exc:
                raise SyncTransportError(f"sync store unreachable: {exc}") from exc
            if found is not None:
                self._next_seq += 1
                return found
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no sync announcement within {timeout} s")
            time.sleep(delay)
            delay = min(delay * 2, self.poll_interval)

    def _log_ignored(self, seq: int, exc: BadMessage) -> None:
        reason = str(exc).encode()
        if self._ignored.get(seq) != reason:  # once per distinct bad value, not every poll
            self._ignored = {seq: reason}
            log.warning("ignored sync announcement %d: %s", seq, exc)


def _digest_problem(header: SyncHeader, digests: list[str]) -> str | None:
    for i, (spec, digest) in enumerate(zip(header.buckets, digests, strict=True)):
        if not spec.sha256:
            return f"bucket {i} has no SHA-256 in the header"
        if digest != spec.sha256:
            return f"bucket {i}: SHA-256 of the received bytes does not match the header"
    return None
