"""Rank-0 file I/O shared by checkpoints and exports: one rank writes, every rank learns whether it
worked, and folders appear atomically (written under a temp name, fsynced, renamed into place)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint (or an export) could not be written or read."""


# ---------------------------------------------------------------- distributed helpers


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _share_from_rank0(obj: Any) -> Any:
    """Rank 0's object on every rank (pickled broadcast; fine for LoRA-sized payloads)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_on_rank0(fn, *args) -> Any:
    """Run `fn` on rank 0 only and re-raise its failure on every rank."""
    result: tuple[bool, Any] = (True, None)
    if rank() == 0:
        try:
            result = (True, fn(*args))
        except Exception as exc:
            log.exception("rank 0 checkpoint I/O failed")
            result = (False, f"{type(exc).__name__}: {exc}")
    ok, value = _share_from_rank0(result)
    if not ok:
        raise CheckpointError(value)
    return value


# ---------------------------------------------------------------- file helpers


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_tree(root: Path) -> None:
    for path in [*sorted(root.rglob("*")), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` onto `final`, moving an existing `final` aside first (rename can't replace a
    non-empty directory)."""
    trash = None
    if final.exists():
        trash = final.with_name(f"{TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}")
        final.rename(trash)
    tmp.rename(final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def write_dir_atomically(out_dir: Path, fill: Callable[[Path], None]) -> None:
    """`fill` writes a folder into a hidden temp sibling, which is fsynced and renamed onto
    `out_dir`: a crash leaves the old folder or the new one, never half of one."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f"{TMP_PREFIX}{out_dir.name}-{uuid.uuid4().hex[:8]}")
    try:
        fill(tmp)
        fsync_tree(tmp)
        replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
