"""Real gloo groups across real processes: the pytest process is the trainer's rank 0 (sender)
and spawned processes are sidecars (receivers)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time

import pytest
import torch

from lorarl.sync.auth import bucket_digest
from lorarl.sync.buckets import Bucket, SyncHeader, pack
from lorarl.sync.errors import SyncClosed, SyncTransportError
from lorarl.sync.transport import SyncReceiver, SyncSender

HOST = "127.0.0.1"
KEY = "test-sync-key"
BUCKET_BYTES = 16 * 1024
MODULES = tuple(f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ("q_proj", "v_proj"))

pytestmark = pytest.mark.timeout(90)


def receiver_main(port, rank, reject_versions, crash_after, results):
    """A scripted sidecar (replica index `rank`, which is also its rank in a group of all of
    them): records every update as raw bytes, acks, reports when closed."""
    records = []
    receiver = SyncReceiver(HOST, port, rank, backend="gloo", timeout=20, key=KEY)
    while True:
        try:
            header, tensors = receiver.recv(timeout=60)
        except SyncClosed:
            break
        except SyncTransportError as exc:
            records.append(("transport_error", str(exc)[:80]))
            continue
        records.append(
            (
                "update", header.version, receiver.generation,
                {n: (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy()
                     .tobytes()) for n, t in tensors.items()},
            )
        )  # fmt: skip
        ok = header.version not in reject_versions
        receiver.ack(header.version, ok, "" if ok else f"rank {rank} rejects v{header.version}")
        if crash_after == header.version:
            results.put((rank, "crashed", records))
            results.close()
            results.join_thread()
            os._exit(0)  # die without closing anything, like a killed pod
    results.put((rank, "closed", records))


def lora_update(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    out = {}
    for i, module in enumerate(MODULES):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(8, 64, generator=g).to(dtype)
        out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(64, 8, generator=g).to(dtype)
    return out


def make_header(version: int) -> SyncHeader:
    return SyncHeader(
        version=version, mode="merged", scaling=2.0, rank=8, alpha=16.0, target_modules=MODULES
    )


def as_bytes(tensors):
    return {
        n: (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
        for n, t in tensors.items()
    }


def start(ctx, results, port, rank, reject=(), crash_after=None):
    proc = ctx.Process(
        target=receiver_main,
        args=(port, rank, tuple(reject), crash_after, results),
        daemon=True,
    )
    proc.start()
    return proc


def collect(results, n, timeout=30.0):
    out = {}
    deadline = time.monotonic() + timeout
    while sum(map(len, out.values())) < n:
        try:
            rank, how, records = results.get(timeout=max(deadline - time.monotonic(), 0.1))
        except queue.Empty:
            got = {rank: [how for how, _ in reports] for rank, reports in out.items()}
            raise AssertionError(f"expected {n} receiver reports, got {got}") from None
        out.setdefault(rank, []).append((how, records))
    return out


@pytest.fixture
def ctx():
    return mp.get_context("spawn")


def test_three_versions_reach_three_receivers_bit_identical(ctx):
    results = ctx.Queue()
    sender = SyncSender(HOST, 0, backend="gloo", timeout=30, bucket_bytes=BUCKET_BYTES, key=KEY)
    procs = [
        start(ctx, results, sender.port, rank, reject=(2,) if rank == 3 else ())
        for rank in (1, 2, 3)
    ]
    assert len(sender.wait_registered(3, timeout=30)) == 3
    sent = {}
    for version in (1, 2, 3):
        tensors = lora_update(version)
        sent[version] = as_bytes(tensors)
        result = sender.send(tensors, make_header(version))
        expected_buckets = pack(tensors, BUCKET_BYTES)
        signed = [  # every bucket's SHA-256 rides in the header, and a 32-byte MAC before it
            Bucket(b.spec.model_copy(update={"sha256": bucket_digest(b.buffer)}), b.buffer)
            for b in expected_buckets
        ]
        header_len = 32 + len(make_header(version).with_buckets(signed).to_bytes())
        assert result.version == version and result.generation == 0
        assert result.stats.buckets == len(expected_buckets) >= 2
        assert result.stats.bytes == 8 + header_len + sum(b.spec.nbytes for b in expected_buckets)
        assert result.stats.seconds > 0
        assert [(a.rank, a.version) for a in result.acks] == [(1, version), (2, version),
                                                              (3, version)]  # fmt: skip
        if version == 2:
            assert not result.ok
            (failed,) = result.failed
            assert (failed.rank, failed.ok, failed.message) == (3, False, "rank 3 rejects v2")
        else:
            assert result.ok and result.failed == []
    sender.close()
    done = collect(results, 3)
    for p in procs:
        p.join(10)
    for rank in (1, 2, 3):
        ((how, records),) = done[rank]
        assert how == "closed"
        assert [r[1] for r in records] == [1, 2, 3]
        for _, version, generation, tensors in records:
            assert generation == 0
            assert tensors == sent[version]  # names, dtypes, shapes and every byte


def test_restarted_receiver_rejoins_and_gets_latest(ctx):
    results = ctx.Queue()
    sender = SyncSender(HOST, 0, backend="gloo", timeout=20, bucket_bytes=BUCKET_BYTES, key=KEY)
    port = sender.port
    healthy = start(ctx, results, port, 1)
    doomed = start(ctx, results, port, 2, crash_after=1)
    assert len(sender.wait_registered(2, timeout=30)) == 2
    v1 = lora_update(1)
    assert sender.send(v1, make_header(1)).ok
    doomed.join(20)
    assert doomed.exitcode == 0

    # The old group (and the store) still names the dead process: sending fails fast.
    v2 = lora_update(2)
    t0 = time.monotonic()
    with pytest.raises(SyncTransportError, match="generation 0"):
        sender.send(v2, make_header(2))
    assert time.monotonic() - t0 < 15

    dead = {m.index: m.incarnation for m in sender.registered()}[2]
    reborn = start(ctx, results, port, 2)
    deadline = time.monotonic() + 30
    while {m.index: m.incarnation for m in sender.registered()}[2] == dead:
        assert time.monotonic() < deadline, "restarted receiver never registered again"
        time.sleep(0.05)
    # A new group with the reborn member gets the newest update, the one that failed.
    catch_up = sender.service_rejoin()
    assert catch_up is not None and catch_up.ok
    assert (catch_up.version, catch_up.generation) == (2, 1)
    assert sender.service_rejoin() is None  # nothing pending any more

    v3 = lora_update(3)
    result = sender.send(v3, make_header(3))
    assert result.ok and (result.version, result.generation) == (3, 1)
    sender.close()
    done = collect(results, 3)
    for p in (healthy, reborn):
        p.join(10)

    updates = {k: [] for k in ("healthy", "crashed", "reborn")}
    for how, records in done[2]:
        updates["crashed" if how == "crashed" else "reborn"] = records
    updates["healthy"] = done[1][0][1]
    want = {1: as_bytes(v1), 2: as_bytes(v2), 3: as_bytes(v3)}

    def summary(records):
        return [r[1:3] if r[0] == "update" else r[0] for r in records]

    assert summary(updates["crashed"]) == [(1, 0)]
    assert summary(updates["reborn"]) == [(2, 1), (3, 1)]  # caught up on v2, then got v3
    healthy_summary = [s for s in summary(updates["healthy"]) if s != "transport_error"]
    assert healthy_summary == [(1, 0), (2, 1), (3, 1)]
    for records in updates.values():
        for r in records:
            if r[0] == "update":
                assert r[3] == want[r[1]]
