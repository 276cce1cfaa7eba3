"""Applies one received update to an engine, all or nothing.

The update is validated against the base model before anything reaches the engine; merged
weights are computed from a pristine base copy (never accumulated into the running weights, so
there is no drift); the last good update is kept so a restarted engine can be brought back to it.
In merged mode an engine that can merge itself (vLLM, through the worker extension) is handed only
the adapter and merges from its own pristine copy (`merge_in="engine"`); otherwise the sidecar
merges and pushes every targeted weight (`merge_in="sidecar"`).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from safetensors import safe_open

from lorarl.rollout.engine import RolloutEngine
from lorarl.sync.adapter_files import write_adapter_dir
from lorarl.sync.buckets import SyncHeader, validate_update
from lorarl.sync.merge import BaseWeights, merge_adapter, weight_files
from lorarl.sync.names import LoraPair, group_lora_pairs, modules_to_send, peft_lora_name
from lorarl.sync.protocol import adapter_name

if TYPE_CHECKING:
    from peft import LoraConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Where merged mode computes W0 + s·B@A: "engine" hands only the adapter to engines that can merge
# in their own workers (vLLM's worker extension), "sidecar" merges here and pushes full weights.
MERGE_IN = ("engine", "sidecar")
DEFAULT_MERGE_IN = "engine"  # bit-identical, fewer bytes, faster on SmolLM2 (bench/sync.py)


@runtime_checkable
class EdgeMergingEngine(Protocol):
    """An engine whose workers merge a LoRA adapter into the weights they hold."""

    def push_adapter_merge(
        self,
        lora_tensors: Mapping[str, torch.Tensor],
        scaling: float,
        base_dir: str | Path,
        version: int,
    ) -> float:
        """Push; returns the seconds the engine spent merging (the slowest worker's)."""
        ...


def model_shapes(model_dir: str | Path) -> dict[str, tuple[int, int]]:
    """Module -> (out, in) of every 2-D weight, read from safetensors headers only."""
    shapes: dict[str, tuple[int, int]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in weight_files(Path(model_dir)).items():
        if name.endswith(".weight"):
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                shape = f.get_slice(name).get_shape()
                if len(shape) == 2:
                    shapes[name.removesuffix(".weight")] = (shape[0], shape[1])
    return shapes


def served_adapter_config(header: SyncHeader, model_dir: str | Path) -> LoraConfig:
    """The adapter config an engine serves the update with, scaled exactly as the trainer.

    SGLang's `LoRAConfig` reads only `r` and `lora_alpha` and scales by alpha/r, so with rsLoRA
    (alpha/sqrt(r)) it would serve a delta sqrt(r) too small. Folding the factor into alpha
    (alpha * sqrt(r) / r = alpha / sqrt(r)) gives every engine (SGLang, vLLM, PEFT) the
    trainer's scaling without relying on `use_rslora` support.
    """
    # Imported here: peft (and transformers under it) is ~4.7 s of every sidecar's start, and a
    # merged-mode sidecar never needs it.
    from peft import LoraConfig

    alpha = header.alpha * math.sqrt(header.rank) if header.use_rslora else header.alpha
    return LoraConfig(
        r=header.rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # PEFT annotates int; it scales by any number
        use_rslora=False,
        target_modules=sorted({m.rsplit(".", 1)[-1] for m in header.target_modules}),
        base_model_name_or_path=str(model_dir),
    )


@dataclass
class Applied:
    header: SyncHeader
    tensors: dict[str, torch.Tensor]
    seconds: dict[str, float] = field(default_factory=dict)


class UpdateApplier:
    def __init__(
        self,
        engine: RolloutEngine,
        model_dir: str | Path,
        mode: str,
        expected_rank: int | None,
        engine_dtype: str,
        adapter_root: str | Path,
        merge_in: str = DEFAULT_MERGE_IN,
    ):
        if merge_in not in MERGE_IN:
            raise ValueError(f"merge_in: {merge_in!r} is not one of {MERGE_IN}")
        self.engine = engine
        # An engine that cannot merge itself (SGLang today) keeps the sidecar merge.
        self.merge_in = merge_in if isinstance(engine, EdgeMergingEngine) else "sidecar"
        self.model_dir = Path(model_dir)
        self.mode = mode
        self.expected_rank = expected_rank
        self.dtype = DTYPES[engine_dtype]
        self.adapter_root = Path(adapter_root)
        self.shapes = model_shapes(self.model_dir)
        self._base: BaseWeights | None = None
        self.current: Applied | None = None
        self.stale = False  # `current` was accepted but the engine does not serve it yet

    def validate(self, header: SyncHeader, tensors: dict[str, torch.Tensor]) -> None:
        if header.mode != self.mode:
            raise ValueError(f"update v{header.version} is for {header.mode!r} mode, "
                             f"this sidecar runs {self.mode!r}")  # fmt: skip
        validate_update(header, self.shapes, self.expected_rank)
        group_lora_pairs(tensors)

    def defer(self, header: SyncHeader, tensors: dict[str, torch.Tensor]) -> Applied:
        """Accept a valid update while the engine is down; `reapply()` delivers it later."""
        self.validate(header, tensors)
        self.current = Applied(header, tensors)
        self.stale = True
        return self.current

    def apply(self, header: SyncHeader, tensors: dict[str, torch.Tensor]) -> Applied:
        t0 = time.perf_counter()
        self.validate(header, tensors)
        pairs = group_lora_pairs(tensors)
        t1 = time.perf_counter()
        if self.mode == "merged":
            seconds = self._push_merged(header, pairs)
        else:
            seconds = self._load_adapter(header, tensors)
        applied = Applied(header, tensors, {"validate": t1 - t0, **seconds})
        self.current = applied
        self.stale = False
        return applied

    def reapply(self) -> Applied | None:
        """After an engine restart: the engine starts from base weights, so replay the last good."""
        if self.current is None:
            return None
        return self.apply(self.current.header, self.current.tensors)

    def _push_merged(self, header: SyncHeader, pairs) -> dict[str, float]:
        if self.merge_in == "engine":
            return self._push_adapter_merge(header, pairs)
        t0 = time.perf_counter()
        send = modules_to_send(list(pairs), known_modules=self.shapes)
        base = self._base_for(send)
        passthrough = [f"{m}.weight" for m in send if m not in pairs]
        named = list(
            merge_adapter(base, pairs, header.scaling, self.dtype, passthrough=passthrough)
        )
        t1 = time.perf_counter()
        self.engine.push_merged_weights(named, header.version)
        return {"merge": t1 - t0, "push": time.perf_counter() - t1}

    def _push_adapter_merge(
        self, header: SyncHeader, pairs: Mapping[str, LoraPair[torch.Tensor]]
    ) -> dict[str, float]:
        """Merged mode without a sidecar merge: only A/B go to the engine, which merges them."""
        assert isinstance(self.engine, EdgeMergingEngine)  # merge_in == "engine" promised it
        lora: dict[str, torch.Tensor] = {}
        for module, pair in pairs.items():
            lora[peft_lora_name(module, "A")] = pair.A
            lora[peft_lora_name(module, "B")] = pair.B
        t0 = time.perf_counter()
        merge_s = self.engine.push_adapter_merge(
            lora, header.scaling, self.model_dir, header.version
        )
        return {"merge": merge_s, "push": time.perf_counter() - t0 - merge_s}

    def _base_for(self, modules: list[str]) -> BaseWeights:
        if self._base is None or any(f"{m}.weight" not in self._base for m in modules):
            self._base = BaseWeights.from_safetensors(self.model_dir, modules)
        return self._base

    def _load_adapter(self, header: SyncHeader, tensors) -> dict[str, float]:
        t0 = time.perf_counter()
        name = adapter_name(header.version)
        folder = self.adapter_root / name
        shutil.rmtree(folder, ignore_errors=True)
        write_adapter_dir(tensors, served_adapter_config(header, self.model_dir), folder)
        t1 = time.perf_counter()
        self.engine.load_adapter(folder, name, header.version)
        previous = self.current.header.version if self.current and not self.stale else None
        if previous is not None and previous != header.version:
            old = adapter_name(previous)
            try:
                self.engine.unload_adapter(old)
            except Exception as exc:  # the new version is live; a stale one only costs memory
                log.warning("could not unload %s: %s", old, exc)
            shutil.rmtree(self.adapter_root / old, ignore_errors=True)
        return {"write": t1 - t0, "load": time.perf_counter() - t1}
