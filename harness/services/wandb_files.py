"""Reading a W&B offline run back from its own record file (no W&B server, no `wandb sync`)."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def wandb_records(run_file: Path) -> Iterator[Any]:
    """The records of a W&B run file (LevelDB log blocks holding wandb's own protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf = run_file.read_bytes(), 32768, 7, b""  # 7: the W&B file header
    assert data.startswith(b":W&B")
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if n == 0 and kind == 0:  # block padding
            pos += left - 7
            continue
        buf, pos = buf + data[pos : pos + n], pos + n
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""


def wandb_history(run_file: Path) -> dict[int, dict[str, Any]]:
    """Every logged history item of a W&B run file, by step."""
    steps: dict[int, dict[str, Any]] = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}  # fmt: skip
            steps.setdefault(record.history.step.num, {}).update(items)
    return steps


def wait_wandb_history(
    run_file: Path, steps: list[int], timeout_s: float = 30.0
) -> dict[int, dict[str, Any]]:
    """The run's history once it holds `steps`: `run.finish()` can return before wandb's own
    service process has written every record (seen under a loaded CI machine), so read again
    until they are there or `timeout_s` passes (then return what is there, for the assert)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            history = wandb_history(run_file)
        except Exception:  # a record half written: read again
            history = {}
        if sorted(history) == sorted(steps) or time.monotonic() > deadline:
            return history
        time.sleep(0.2)
