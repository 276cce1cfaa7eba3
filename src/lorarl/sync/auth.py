"""Authenticating the sync channel with the job's key (`LORARL_SYNC_KEY`).

The store (a TCPStore) has no access control: anyone who reaches its port can read and write any
key, and can even take rank 0's place in a group's rendezvous. So nothing read from it, or from
the group, is trusted until it verifies: every announcement, control value and header carries an
HMAC-SHA256 under the job's key, and the signed header carries a SHA-256 of every bucket.

What a MAC covers: a purpose string (an announcement can never pass as a header or a control
value), the generation and operation number (so a captured announcement or header cannot be
replayed as another operation), and the message's canonical bytes. Not covered: a message
captured from an earlier trainer of the same job (same key, new store) verifies again at the same
operation number and generation; see docs/security.md.
Failures raise `BadMessage` with a short reason, never anything else: the caller decides to
ignore (a store key) or to refuse (a header), and keeps serving.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

from lorarl.api.spec.workloads import SYNC_KEY_ENV
from lorarl.sync.errors import SyncKeyMissing

MAC_BYTES = 32
MAX_CONTROL_BYTES = 4096  # a control value or registration; anything longer is not ours
MAX_ANNOUNCEMENT_BYTES = 128 * 1024  # room for the member list of a 4096-replica group
OPS = ("sync", "close")


class BadMessage(ValueError):
    """A store value or header that does not verify or does not parse; str() is the reason."""


def key_from_env(env: Mapping[str, str] | None = None) -> bytes:
    """The job's sync key; a sync process without one refuses to start."""
    value = (os.environ if env is None else env).get(SYNC_KEY_ENV, "")
    if not value:
        raise SyncKeyMissing(
            f"{SYNC_KEY_ENV} is not set: the weight-sync channel needs the job's key (the operator "
            "puts it in the job's Secret; `lorarl run --local` generates one per run)"
        )
    return value.encode()


def resolve_key(key: str | bytes | None) -> bytes:
    if key is None:
        return key_from_env()
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw:
        raise SyncKeyMissing(f"the sync key ({SYNC_KEY_ENV}) must not be empty")
    return raw


class Announcement(NamedTuple):
    op: str
    generation: int
    seq: int
    members: tuple[str, ...] = ()  # "<index>:<incarnation>" in rank order (rank = position + 1)


@dataclass(frozen=True)
class Registration:
    """A receiver's entry in the store: who it is and where the trainer reaches it. (Not a
    NamedTuple: its `index` field, which is on the wire, would shadow tuple.index.)"""

    index: int  # the rollout replica index (pod `<job>-rollout-<index>`)
    incarnation: str  # fresh per process start: a restarted sidecar is a new member
    engine: str  # the engine's URL as the trainer reaches it ("" when not advertised)
    sidecar: str  # the sidecar's status URL

    @property
    def token(self) -> str:
        return f"{self.index}:{self.incarnation}"


MAX_MEMBERS = 4096
_TOKEN_CHARS = set("0123456789abcdef:")


def _int(value: Any, field: str, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise BadMessage(f"{field} must be an integer >= {minimum}, got {value!r:.40}")
    return value


def _json_object(raw: bytes | str, what: str, limit: int = MAX_CONTROL_BYTES) -> dict[str, Any]:
    if len(raw) > limit:
        raise BadMessage(f"{what}: {len(raw)} bytes, more than {limit}")
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise BadMessage(f"{what}: not JSON") from None
    if not isinstance(value, dict):
        raise BadMessage(f"{what}: not a JSON object")
    return value


class Signer:
    """Signs and verifies the channel's messages under one job key."""

    def __init__(self, key: bytes):
        self._key = key

    def mac(self, purpose: str, generation: int, seq: int, payload: bytes) -> bytes:
        context = json.dumps([purpose, generation, seq]).encode()
        return hmac.new(self._key, context + b"\n" + payload, hashlib.sha256).digest()

    def _check(self, mac: Any, purpose: str, generation: int, seq: int, payload: bytes) -> None:
        try:
            given = bytes.fromhex(mac) if isinstance(mac, str) else b""
        except ValueError:
            given = b""
        want = self.mac(purpose, generation, seq, payload)
        if not hmac.compare_digest(given, want):
            raise BadMessage(f"{purpose}: bad MAC (not signed with this job's {SYNC_KEY_ENV})")

    # -- announcements: {"op", "generation", "seq", "mac"} at ctl/announce/<seq> -------------

    def announcement(
        self, op: str, generation: int, seq: int, members: tuple[str, ...] = ()
    ) -> str:
        fields = {"op": op, "generation": generation, "seq": seq, "members": list(members)}
        mac = self.mac("announce", generation, seq, _canonical(fields)).hex()
        return json.dumps({**fields, "mac": mac})

    def open_announcement(self, raw: bytes | str, seq: int) -> Announcement:
        value = _json_object(raw, f"announcement {seq}", MAX_ANNOUNCEMENT_BYTES)
        op = value.get("op")
        if op not in OPS:
            raise BadMessage(f"announcement {seq}: op must be one of {OPS}, got {op!r:.40}")
        generation = _int(value.get("generation"), "generation", -1)
        if _int(value.get("seq"), "seq", 0) != seq:
            raise BadMessage(f"announcement {seq}: carries seq {value['seq']}")
        members = value.get("members")
        if (
            not isinstance(members, list)
            or len(members) > MAX_MEMBERS
            or not all(isinstance(m, str) and set(m) <= _TOKEN_CHARS for m in members)
        ):
            raise BadMessage(f"announcement {seq}: members must be a list of member tokens")
        fields = {"op": op, "generation": generation, "seq": seq, "members": members}
        self._check(value.get("mac"), "announce", generation, seq, _canonical(fields))
        return Announcement(op, generation, seq, tuple(members))

    # -- registrations: {"index", "incarnation", "engine", "sidecar", "mac"} at member/<index>

    def registration(self, member: Registration) -> str:
        fields = asdict(member)
        mac = self.mac(f"member:{member.index}", 0, 0, _canonical(fields)).hex()
        return json.dumps({**fields, "mac": mac})

    def open_registration(self, raw: bytes | str, index: int) -> Registration:
        value = _json_object(raw, f"member {index}")
        if _int(value.get("index"), "index", 0) != index:
            raise BadMessage(f"member {index}: carries index {value['index']}")
        incarnation, engine, sidecar = (value.get(k) for k in ("incarnation", "engine", "sidecar"))
        if not (isinstance(incarnation, str) and incarnation and set(incarnation) <= _TOKEN_CHARS):
            raise BadMessage(f"member {index}: incarnation must be a hex string")
        if not isinstance(engine, str) or not isinstance(sidecar, str):
            raise BadMessage(f"member {index}: engine and sidecar must be strings")
        member = Registration(index, incarnation, engine, sidecar)
        self._check(value.get("mac"), f"member:{index}", 0, 0, _canonical(asdict(member)))
        return member

    # -- control values (the latest seq, the latest formed generation) -----------------------

    def value(self, name: str, number: int) -> str:
        mac = self.mac(f"value:{name}", 0, 0, str(number).encode()).hex()
        return json.dumps({name: number, "mac": mac})

    def open_value(self, name: str, raw: bytes | str) -> int:
        value = _json_object(raw, name)
        number = _int(value.get(name), name, -1)
        self._check(value.get("mac"), f"value:{name}", 0, 0, str(number).encode())
        return number

    # -- acknowledgements: the receiver's verdict on operation <seq>, gathered by the sender

    def ack(self, index: int, generation: int, seq: int, payload: bytes) -> bytes:
        return self.mac(f"ack:{index}", generation, seq, payload)

    def check_ack(self, index: int, generation: int, seq: int, payload: bytes, mac: bytes) -> None:
        self._check(mac.hex(), f"ack:{index}", generation, seq, payload)

    # -- headers: MAC (32 bytes) + the header's JSON, broadcast through the group -----------

    def seal_header(self, header_json: bytes, generation: int, seq: int) -> bytes:
        return self.mac("header", generation, seq, header_json) + header_json

    def open_header(self, data: bytes, generation: int, seq: int) -> bytes:
        if len(data) <= MAC_BYTES:
            raise BadMessage(f"header: {len(data)} bytes, too short to carry a MAC")
        mac, body = data[:MAC_BYTES], data[MAC_BYTES:]
        self._check(mac.hex(), "header", generation, seq, body)
        return body


def _canonical(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def bucket_digest(buffer: torch.Tensor) -> str:
    """SHA-256 of a bucket's bytes (a CUDA bucket is hashed from a host copy)."""
    host = buffer.detach().reshape(-1).cpu()
    return hashlib.sha256(host.numpy().data).hexdigest()
