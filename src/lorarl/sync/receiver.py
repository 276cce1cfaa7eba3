"""The receiving end of the sync wire (a sidecar); the protocol is described in `transport`.

Nothing read from the store or the group is trusted before it verifies: an announcement that
does not is ignored, a header that does not makes the receiver leave the operation and say why,
and a signed update whose layout or bytes do not fit is nacked. None of it raises anything but a
`SyncError`, so a sidecar keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import NoReturn

import torch
from pydantic import ValidationError

from lorarl.sync.auth import (
    MAX_MEMBERS,
    Announcement,
    BadMessage,
    Registration,
    Signer,
    bucket_digest,
    resolve_key,
)
from lorarl.sync.buckets import SyncHeader, check_layout, unpack_all
from lorarl.sync.errors import (
    SyncClosed,
    SyncError,
    SyncRefused,
    SyncTransportError,
    UpdateValidationError,
)
from lorarl.sync.group import (
    DEFAULT_FORM_TIMEOUT_S,
    Endpoint,
    Received,
    TransferStats,
    device_for,
    encode_ack,
)
from lorarl.sync.store import connect_store

log = logging.getLogger("lorarl.sync")

MAX_HEADER_BYTES = 16 * 1024 * 1024  # ~100x a 70B model's all-linear LoRA header
MAX_NACK_CHARS = 300
MAX_SCAN = 1_000_000  # announcements a receiver walks when the store's pointers are poisoned
REGISTRATION_CHECK_S = 5.0
SCAN_AHEAD = 16  # registration slots the sender reads past the highest index it has seen


def member_key(index: int) -> str:
    """Where replica `index` registers (under the control prefix)."""
    return f"member/{index}"


class SyncReceiver:
    """A sidecar: registers in the sender's store, waits for announcements, receives updates.

    `index` is the rollout replica index (the pod's ordinal); `engine_url` and `sidecar_url` are
    where the trainer reaches this replica, published with the registration. `key` is the job's
    sync key; None reads `LORARL_SYNC_KEY` (a missing key is an error)."""

    def __init__(
        self,
        host: str,
        port: int,
        index: int,
        backend: str,
        timeout: float = 120.0,
        device: torch.device | str | None = None,
        poll_interval: float = 0.05,
        key: str | bytes | None = None,
        *,
        engine_url: str = "",
        sidecar_url: str = "",
        form_timeout: float = DEFAULT_FORM_TIMEOUT_S,
    ):
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_MEMBERS:
            raise ValueError(f"index must be a replica index in [0, {MAX_MEMBERS}), got {index!r}")
        device_for(backend, device or "cpu")
        self._signer = Signer(resolve_key(key))
        store = connect_store(host, port, timeout)
        self._ep = Endpoint(store, str(index), backend, timeout, device, form_timeout)
        self.registration = Registration(index, secrets.token_hex(8), engine_url, sidecar_url)
        self.poll_interval = poll_interval
        self._pending_version: int | None = None
        self._pending_op = (-1, -1)
        self._ignored: dict[int, bytes] = {}  # announcement seq -> the bad value last logged
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="lorarl-sync-sha256")
        self.last_stats: TransferStats | None = None
        try:
            seq = self._read_value("seq")
        except BadMessage as exc:
            log.warning("sync store pointers do not verify (%s); scanning announcements", exc)
            _, seq = self._scan()
        # A generation's member list names this process's incarnation only after it registers,
        # so no generation formed before now can include it; the minimum only rises on failures.
        self._min_generation = 0
        self._next_seq = max(seq, 0)
        self._next_registration_check = time.monotonic() + REGISTRATION_CHECK_S
        self.register()

    @property
    def index(self) -> int:
        return self.registration.index

    def register(self) -> None:
        """(Re-)publish this receiver's registration: the sender adds it at its next check."""
        value = self._signer.registration(self.registration)
        try:
            self._ep.ctl.set(member_key(self.index), value)
        except RuntimeError as exc:
            raise SyncTransportError(f"sync store unreachable: {exc}") from exc

    def _keep_registered(self) -> None:
        """Re-register if our entry is gone or is not ours (deleted or overwritten by someone
        with store access): checked every few seconds while waiting for work."""
        now = time.monotonic()
        if now < self._next_registration_check:
            return
        self._next_registration_check = now + REGISTRATION_CHECK_S
        key = member_key(self.index)
        try:
            raw = self._ep.ctl.get(key) if self._ep.ctl.check([key]) else None
            if raw is not None and self._signer.open_registration(raw, self.index) == (
                self.registration
            ):
                return
        except BadMessage:
            pass
        except RuntimeError:
            return  # the store is unreachable: the announcement wait reports it
        log.warning("sync registration of replica %d was missing or altered; re-registering",
                    self.index)  # fmt: skip
        self.register()

    def leave(self) -> None:
        """Deregister (a pod being deleted or scaled down): the sender drops this replica at its
        next check instead of finding it unreachable. Best effort: the store may be gone."""
        key = member_key(self.index)
        with contextlib.suppress(RuntimeError, BadMessage):
            current = self._signer.open_registration(self._ep.ctl.get(key), self.index)
            if current.incarnation == self.registration.incarnation:  # not a successor's entry
                self._ep.ctl.delete_key(key)
        self.close()

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
            op, generation, seq, members = self._wait_announcement(timeout)
            if op == "close":
                ep.drop()
                with contextlib.suppress(RuntimeError):  # the sender may be gone already
                    ep.mark(f"closed/{seq}")
                raise SyncClosed("sender closed the sync channel")
            if generation < self._min_generation:
                continue  # one we failed in: the sender forms a new one for our rejoin request
            try:
                rank = members.index(self.registration.token) + 1
            except ValueError:
                ep.drop()  # a generation without us: whatever group we were in is over
                continue
            if generation != ep.group.generation:
                ep.form(generation, rank, 1 + len(members))
            return self._receive_update(generation, seq)

    def ack(self, version: int, ok: bool = True, message: str = "") -> None:
        """Report the outcome of the last update; the sender's send() returns once all ack."""
        if self._pending_version is None:
            raise SyncError("ack() without a received update")
        ep = self._ep
        try:
            generation, seq = self._pending_op
            seal = partial(self._signer.ack, self.index, generation, seq)
            ep.all_gather_acks(encode_ack(version, ok, message, ep.device, seal=seal))
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
        self._pending_op = (generation, seq)  # what the ack's MAC binds it to
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
            self._ep.ctl.set(f"nack/{seq}/{self.index}", reason[:MAX_NACK_CHARS])
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
            f"replica {self.index}: sync group generation {generation} failed: {exc}"
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
            self._keep_registered()
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
