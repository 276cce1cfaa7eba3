"""Wire format: a JSON header plus contiguous byte buckets.

Tensors are flattened into uint8 buffers so one collective moves many small LoRA matrices of any
dtype (bf16 included, which some collectives lack); the header says where each tensor lives.
Buckets are bounded so a receiver never needs one huge staging buffer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from lorarl.sync.errors import LoraNameError, UnsupportedLoraError, UpdateValidationError
from lorarl.sync.merge import lora_scaling
from lorarl.sync.names import parse_lora_name

ALIGN = 16  # every tensor starts on a 16-byte boundary, so dtype views of the buffer are legal

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise UpdateValidationError(f"dtype {dtype} cannot be synced (supported: {sorted(DTYPES)})")


class TensorEntry(BaseModel):
    """Where one tensor lives in its bucket."""

    model_config = ConfigDict(frozen=True)

    name: str
    shape: tuple[Annotated[int, Field(ge=0)], ...]
    dtype: str
    offset: int = Field(ge=0)
    numel: int = Field(ge=0)

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in DTYPES:
            raise ValueError(f"unsupported dtype {v!r} (supported: {sorted(DTYPES)})")
        return v

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


class BucketSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    nbytes: int = Field(ge=0)
    entries: tuple[TensorEntry, ...]
    sha256: str = ""  # of the bucket's bytes; the transport fills it in and checks it


class SyncHeader(BaseModel):
    """Everything a receiver needs to interpret and check one update."""

    model_config = ConfigDict(frozen=True)

    version: int = Field(ge=0)
    mode: Literal["merged", "adapter"]
    scaling: float = Field(gt=0)
    rank: int = Field(gt=0)
    alpha: float = Field(gt=0)
    use_rslora: bool = False
    target_modules: tuple[str, ...]
    buckets: tuple[BucketSpec, ...] = ()

    def with_buckets(self, buckets: Sequence[Bucket]) -> SyncHeader:
        return self.model_copy(update={"buckets": tuple(b.spec for b in buckets)})

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> SyncHeader:
        return cls.model_validate_json(data)

    @property
    def payload_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


@dataclass(frozen=True)
class Bucket:
    spec: BucketSpec
    buffer: torch.Tensor  # 1-D uint8, spec.nbytes long


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _layout(
    tensors: Mapping[str, torch.Tensor], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor, int]]]:
    """Greedy, order-preserving split into buckets of (name, tensor, offset)."""
    groups: list[list[tuple[str, torch.Tensor, int]]] = []
    current: list[tuple[str, torch.Tensor, int]] = []
    used = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        start = _aligned(used)
        if current and start + nbytes > bucket_bytes:
            groups.append(current)
            current, start = [], 0
        current.append((name, t, start))
        used = start + nbytes
    if current:
        groups.append(current)
    return groups


def pack(
    tensors: Mapping[str, torch.Tensor],
    bucket_bytes: int,
    device: torch.device | str | None = None,
) -> list[Bucket]:
    """Copy tensors into uint8 buckets of at most `bucket_bytes` (a larger tensor gets its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[Bucket] = []
    for group in _layout(tensors, bucket_bytes):
        entries = []
        _, last_t, last_off = group[-1]
        size = last_off + last_t.numel() * last_t.element_size()
        target = device if device is not None else group[0][1].device
        buffer = torch.zeros(size, dtype=torch.uint8, device=target)
        for name, t, off in group:
            entries.append(
                TensorEntry(
                    name=name,
                    shape=tuple(t.shape),
                    dtype=dtype_name(t.dtype),
                    offset=off,
                    numel=t.numel(),
                )
            )
            raw = _as_bytes(t)
            buffer[off : off + raw.numel()].copy_(raw)
        buckets.append(Bucket(BucketSpec(nbytes=size, entries=tuple(entries)), buffer))
    return buckets


def unpack(
    buffer: torch.Tensor, entries: Sequence[TensorEntry], copy: bool = False
) -> dict[str, torch.Tensor]:
    """Tensors of one bucket: views into `buffer` (zero-copy) or, with copy=True, owned copies."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise UpdateValidationError(
            f"bucket buffer must be 1-D uint8, got {buffer.dtype} {tuple(buffer.shape)}"
        )
    out: dict[str, torch.Tensor] = {}
    problems = _entry_problems(entries, buffer.numel())
    if problems:
        raise UpdateValidationError("; ".join(problems))
    for e in entries:
        end = e.offset + e.nbytes
        t = buffer[e.offset : end].view(e.torch_dtype).view(e.shape)
        out[e.name] = t.clone() if copy else t
    return out


def _entry_problems(entries: Sequence[TensorEntry], nbytes: int) -> list[str]:
    """Why these entries cannot be views of an `nbytes` bucket: shape, bounds, alignment,
    overlap. A header that lies must be refused here, not crash a `view()` later."""
    problems = []
    spans = []
    for e in entries:
        end = e.offset + e.nbytes
        if math.prod(e.shape) != e.numel:
            problems.append(f"{e.name!r}: shape {e.shape} != {e.numel} values")
        elif end > nbytes:
            problems.append(
                f"{e.name!r}: bytes [{e.offset}, {end}) exceed the bucket ({nbytes} bytes)"
            )
        elif e.offset % e.torch_dtype.itemsize:
            problems.append(f"{e.name!r}: offset {e.offset} is not a multiple of {e.dtype}'s size")
        elif e.nbytes:
            spans.append((e.offset, end, e.name))
    reach, last = 0, ""  # the furthest byte covered so far, and by which tensor
    for start, end, name in sorted(spans):
        if start < reach:
            problems.append(f"{name!r} overlaps {last!r}")
        if end > reach:
            reach, last = end, name
    return problems


def check_layout(header: SyncHeader, max_problems: int = 3) -> None:
    """Refuse a header whose layout does not fit its own buckets, before any bytes arrive."""
    problems: list[str] = []
    names: set[str] = set()
    for i, spec in enumerate(header.buckets):
        problems += [f"bucket {i}: {p}" for p in _entry_problems(spec.entries, spec.nbytes)]
        for e in spec.entries:
            if e.name in names:
                problems.append(f"{e.name!r} appears twice")
            names.add(e.name)
    if problems:
        shown = "; ".join(problems[:max_problems])
        more = f" (and {len(problems) - max_problems} more)" if len(problems) > max_problems else ""
        raise UpdateValidationError(f"update v{header.version}: bad layout: {shown}{more}")


def unpack_all(
    buffers: Sequence[torch.Tensor], header: SyncHeader, copy: bool = False
) -> dict[str, torch.Tensor]:
    if len(buffers) != len(header.buckets):
        raise UpdateValidationError(
            f"got {len(buffers)} buckets, header announces {len(header.buckets)}"
        )
    out: dict[str, torch.Tensor] = {}
    for buf, spec in zip(buffers, header.buckets, strict=True):
        tensors = unpack(buf, spec.entries, copy=copy)
        if len(tensors) != len(spec.entries) or out.keys() & tensors.keys():
            raise UpdateValidationError(f"update v{header.version}: a tensor name appears twice")
        out.update(tensors)
    return out


def validate_update(
    header: SyncHeader, base_shapes: Mapping[str, tuple[int, int]], expected_rank: int | None
) -> None:
    """Reject an update that would not fit the receiver's base model, naming the bad tensor.
    `expected_rank` None: the receiver cannot tell (an adapter's rank, the adapter not here), so
    the header's rank, which the trainer read from the adapter, is the one the shapes must have."""
    problems: list[str] = []
    if expected_rank is None:
        expected_rank = header.rank
    elif header.rank != expected_rank:
        problems.append(f"header rank {header.rank} != expected rank {expected_rank}")
    expected_scaling = lora_scaling(header.alpha, header.rank, header.use_rslora)
    if not math.isclose(header.scaling, expected_scaling, rel_tol=1e-6):
        problems.append(
            f"header scaling {header.scaling} != {expected_scaling} from alpha={header.alpha}, "
            f"rank={header.rank}, use_rslora={header.use_rslora}"
        )
    seen: dict[str, set[str]] = {}
    for spec in header.buckets:
        for e in spec.entries:
            try:
                parsed = parse_lora_name(e.name)
            except (LoraNameError, UnsupportedLoraError) as exc:
                problems.append(str(exc))
                continue
            module = parsed.module
            parts = seen.setdefault(module, set())
            if parsed.part in parts:
                problems.append(f"{e.name!r}: lora_{parsed.part} of {module!r} sent twice")
            parts.add(parsed.part)
            if module not in base_shapes:
                problems.append(f"{e.name!r}: module {module!r} is not in the base model")
                continue
            out_f, in_f = base_shapes[module]
            want = (expected_rank, in_f) if parsed.part == "A" else (out_f, expected_rank)
            if tuple(e.shape) != want:
                dims = "[r, in]" if parsed.part == "A" else "[out, r]"
                problems.append(
                    f"{e.name!r}: shape {list(e.shape)} but base {module!r} is "
                    f"[out={out_f}, in={in_f}] so lora_{parsed.part} must be {dims} = {list(want)}"
                )
    for module, parts in seen.items():
        if parts != {"A", "B"}:
            problems.append(f"module {module!r}: only lora_{''.join(sorted(parts))} was sent")
    declared = set(header.target_modules)
    if set(seen) != declared:
        extra = sorted(set(seen) - declared)
        absent = sorted(declared - set(seen))
        if extra:
            problems.append(f"tensors for modules not in header.target_modules: {extra[:5]}")
        if absent:
            problems.append(f"header.target_modules without tensors: {absent[:5]}")
    if problems:
        raise UpdateValidationError(f"update v{header.version} rejected: " + "; ".join(problems))
