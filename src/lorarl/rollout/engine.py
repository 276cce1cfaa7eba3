"""The rollout-engine interface the sync sidecar drives, whichever engine (SGLang, vLLM) serves.

The sidecar only ever needs: is the engine up, swap the weights (merged mode) or an adapter
(adapter mode), and drop KV state computed with old weights. Everything engine-specific (HTTP
routes, payload fields, how tensors reach the workers) lives behind this interface.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from torch import Tensor

# HF leaf modules that engines stack into one fused module (vLLM qkv_proj / gate_up_proj, SGLang
# likewise). Sending one member alone makes the loader fill its siblings with garbage.
FUSED_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)

# Fragments that only exist in PEFT-wrapped names; engines know nothing about them.
_PEFT_FRAGMENTS = ("base_model.model.", ".base_layer.", ".lora_A.", ".lora_B.")


class EngineError(RuntimeError):
    """The engine refused or failed an operation; the message says which and why."""


def missing_fused_siblings(
    names: Iterable[str], groups: Iterable[tuple[str, ...]] = FUSED_GROUPS
) -> dict[str, list[str]]:
    """Map each sent name whose fused group is incomplete to the sibling names that are missing.

    Pure, so the rule can be checked without an engine: `a.b.q_proj.weight` requires
    `a.b.k_proj.weight` and `a.b.v_proj.weight` to be sent in the same update.
    """
    sent = set(names)
    member_of = {leaf: group for group in groups for leaf in group}
    missing: dict[str, list[str]] = {}
    for name in sorted(sent):
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in member_of:
            continue
        leaf, suffix = parts[-2], parts[-1]
        prefix = ".".join(parts[:-2])
        siblings = [
            ".".join([*filter(None, [prefix]), other, suffix])
            for other in member_of[leaf]
            if other != leaf
        ]
        absent = [s for s in siblings if s not in sent]
        if absent:
            missing[name] = absent
    return missing


def collect_update(named_tensors: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """One merged update as a dict; a name sent twice is a sender bug, not a last-one-wins."""
    named: dict[str, Tensor] = {}
    for name, tensor in named_tensors:
        if name in named:
            raise EngineError(f"merged weight {name!r} appears twice in one update")
        named[name] = tensor
    return named


def validate_merged_update(
    named: Mapping[str, Tensor], known_shapes: Mapping[str, Sequence[int]] | None = None
) -> None:
    """Refuse an update an engine would corrupt itself with (see FUSED_GROUPS) or die on.

    `known_shapes` (checkpoint name -> shape): vLLM's loader raises on an unknown name or a
    wrong shape mid-reload, which kills the engine core, so such tensors must never reach it.
    """
    if not named:
        raise EngineError("merged weight update is empty: nothing to push")
    for name, tensor in named.items():
        if not isinstance(tensor, Tensor):
            raise EngineError(f"merged weight {name!r} is a {type(tensor).__name__}, not a Tensor")
        wrapped = [f for f in _PEFT_FRAGMENTS if f in f".{name}."]
        if wrapped:
            raise EngineError(
                f"merged weight {name!r} has PEFT name fragment(s) {wrapped}: send Hugging Face "
                "names (strip 'base_model.model.' and '.base_layer')"
            )
    if known_shapes is not None:
        unknown = sorted(set(named) - set(known_shapes))
        if unknown:
            raise EngineError(
                f"merged weight(s) {unknown[:5]} not in the served checkpoint "
                f"({len(unknown)} unknown name(s)); expected Hugging Face names like "
                f"{sorted(known_shapes)[:1]}"
            )
        for name, tensor in named.items():
            if tuple(tensor.shape) != tuple(known_shapes[name]):
                raise EngineError(
                    f"merged weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"the checkpoint's is {tuple(known_shapes[name])}"
                )
    missing = missing_fused_siblings(named)
    if missing:
        first, absent = next(iter(missing.items()))
        raise EngineError(
            f"partial fused group: {first!r} sent without {absent} "
            f"({len(missing)} name(s) affected); engines fuse q/k/v and gate/up, so a group "
            "must be sent whole or the missing members are overwritten with garbage"
        )


E = TypeVar("E", bound="RolloutEngine")


class RolloutEngine(ABC):
    """One rollout engine server as seen by the sync sidecar."""

    @property
    @abstractmethod
    def weight_version(self) -> int | None:
        """Version of the last successful weight/adapter update (None: still the start weights)."""

    @abstractmethod
    def health(self) -> bool:
        """True when the engine answers its health check; never raises."""

    def wait_ready(self, timeout: float, poll: float = 0.5) -> None:
        """Block until healthy; engines take seconds to minutes to load a model."""
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() >= deadline:
                raise EngineError(f"engine not healthy after {timeout:.1f} s")
            time.sleep(poll)

    @abstractmethod
    def push_merged_weights(
        self, named_tensors: Iterable[tuple[str, Tensor]], version: int
    ) -> None:
        """Replace the named base weights (HF names, engine dtype) and flush the prefix cache."""

    @abstractmethod
    def load_adapter(self, adapter_dir: str | Path, name: str, version: int) -> None:
        """Serve the PEFT adapter in `adapter_dir` as model `name`, replacing any older copy."""

    @abstractmethod
    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`."""

    @abstractmethod
    def flush_cache(self) -> None:
        """Drop cached KV blocks: they were computed with weights that no longer exist."""

    @abstractmethod
    def close(self) -> None:
        """Release connections (and any update group); the engine process itself keeps running."""

    def __enter__(self: E) -> E:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
