"""Reading a W&B offline run back from its own record file (no W&B server, no `wandb sync`)."""

from __future__ import annotations

import json
import struct
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
