"""Merged-mode math: W = W_base + s·(B @ A), always from a pristine base.

Merging into the engine's running weights step after step accumulates rounding (bf16 especially);
recomputing from a base copy that is never written makes every version exact and independent of
the versions before it. The merge runs in fp32 and casts once at the end for the same reason.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from lorarl.sync.errors import UpdateValidationError
from lorarl.sync.names import LoraPair

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def lora_scaling(alpha: float, rank: int, use_rslora: bool = False) -> float:
    """PEFT's scaling: alpha/r, or alpha/sqrt(r) with rsLoRA."""
    if rank <= 0:
        raise ValueError(f"rank must be > 0, got {rank}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def merge_weight(
    w_base: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    scaling: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Return a new tensor W_base + scaling·(B @ A); `w_base` is never written."""
    if A.dim() != 2 or B.dim() != 2 or w_base.dim() != 2:
        raise UpdateValidationError(
            f"merge needs 2-D tensors, got base {tuple(w_base.shape)}, A {tuple(A.shape)}, "
            f"B {tuple(B.shape)}"
        )
    out_features, in_features = w_base.shape
    if A.shape[1] != in_features or B.shape[0] != out_features or A.shape[0] != B.shape[1]:
        raise UpdateValidationError(
            f"shapes disagree: base {tuple(w_base.shape)} needs A [r, {in_features}] and "
            f"B [{out_features}, r], got A {tuple(A.shape)} and B {tuple(B.shape)}"
        )
    device = w_base.device
    f32 = torch.float32
    # Same order as PEFT's get_delta_weight: (B @ A) * s, then base + delta. The `+` allocates,
    # so a base already in fp32 is never modified in place.
    delta = B.to(device=device, dtype=f32) @ A.to(device=device, dtype=f32)
    merged = w_base.to(f32) + delta.mul_(scaling)
    return merged.to(out_dtype or w_base.dtype)


def merge_adapter(
    base: Mapping[str, torch.Tensor],
    pairs: Mapping[str, LoraPair[torch.Tensor]],
    scaling: float,
    out_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    passthrough: Iterable[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_weight_name, merged) one module at a time.

    A generator so only one module's base copy, delta and result sit on `device` at once.
    `base` is keyed by Hugging Face weight name (`<module>.weight`). `passthrough` names base
    weights to yield unchanged (cast only) — the untargeted fused siblings an engine needs.
    """
    for module, pair in pairs.items():
        name = f"{module}.weight"
        if name not in base:
            raise UpdateValidationError(f"{name!r}: no base weight loaded for module {module!r}")
        w = base[name]
        if device is not None:
            w = w.to(device)
        yield name, merge_weight(w, pair.A, pair.B, scaling, out_dtype)
    for name in passthrough:
        if name not in base:
            raise UpdateValidationError(f"{name!r}: no base weight loaded for passthrough")
        w = base[name]
        yield name, w.to(device=device or w.device, dtype=out_dtype or w.dtype, copy=True)


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map each tensor name to its safetensors file (single file or sharded index)."""
    index = model_dir / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


_weight_files = weight_files  # old private name, still imported by rollout/applier.py


class BaseWeights(Mapping[str, torch.Tensor]):
    """Pristine base weights of the modules a sync touches, keyed by Hugging Face weight name."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = dict(tensors)

    @classmethod
    def from_safetensors(
        cls, model_dir: str | Path, module_names: Iterable[str], device: str = "cpu"
    ) -> BaseWeights:
        """Load only `<module>.weight` for the given modules, reading each shard once."""
        model_dir = Path(model_dir)
        files = weight_files(model_dir)
        wanted = [f"{m}.weight" for m in dict.fromkeys(module_names)]
        missing = [n for n in wanted if n not in files]
        if missing:
            hint = ""
            if "lm_head.weight" in missing and "model.embed_tokens.weight" in files:
                hint = " (lm_head is tied to embed_tokens; merged sync cannot update a tied head)"
            raise UpdateValidationError(
                f"{model_dir}: base weights not in checkpoint: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}{hint}"
            )
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(files[name], []).append(name)
        tensors: dict[str, torch.Tensor] = {}
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt", device=device) as f:
                for name in names:
                    tensors[name] = f.get_tensor(name)
        return cls({name: tensors[name] for name in wanted})

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Module name -> (out_features, in_features), what `validate_update` checks against."""
        out: dict[str, tuple[int, int]] = {}
        for name, t in self._tensors.items():
            if t.dim() == 2:
                out[name.removesuffix(".weight")] = (int(t.shape[0]), int(t.shape[1]))
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
