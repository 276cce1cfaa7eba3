"""The LoRA path's compute dtype on CPU: the base model's (bf16), not the adapter's fp32.

PEFT keeps LoRA weights in fp32 over a bf16 base (the optimizer needs fp32 state), and each
LoRA layer casts its input up to fp32 for its two small matmuls and back. On a CPU with native
bf16 those casts and fp32 matmuls made up a sixth of the update (docs/architecture.md, Measured
facts). On GPU FSDP2's mixed precision already computes in bf16 (`parallel.shard_model`); on CPU
there is no FSDP mixed precision, so every policy forward runs under `torch.autocast` in the
base dtype with PEFT's input casting off: the same arithmetic FSDP2 gives on GPU (bf16 compute,
fp32 parameters, gradients and optimizer state). It is a property of the model, set once, so the
policy, old-policy and reference passes of a step all compute alike (a ratio of 1 at the step's
start stays exactly 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft.helpers import disable_input_dtype_casting
from torch import nn

from lorarl.trainer.model.loading import lora_parameters

_AUTOCAST_ATTR = "_lorarl_lora_autocast"
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def cpu_lora_autocast_dtype(
    model: nn.Module, device: torch.device, mixed_precision: bool
) -> torch.dtype | None:
    """The dtype to run the LoRA path in: the base's, on CPU, when the base is bf16/fp16, the
    adapter is fp32 and mixed precision is on (`trainer.fsdp.mixedPrecision`). None otherwise:
    an fp32 model computes exactly as before, and a GPU gets it from FSDP2."""
    if device.type != "cpu" or not mixed_precision:
        return None
    frozen = {p.dtype for _, p in model.named_parameters() if not p.requires_grad}
    lora = {p.dtype for _, p in lora_parameters(model)}
    if len(frozen) != 1 or lora != {torch.float32}:
        return None
    (base,) = frozen
    return base if base in _LOW_PRECISION else None


def set_lora_autocast(model: nn.Module, dtype: torch.dtype | None) -> None:
    setattr(model, _AUTOCAST_ATTR, dtype)


@contextmanager
def lora_compute(model: nn.Module) -> Iterator[None]:
    """Around a policy forward (not the backward: autocast records what it needs)."""
    dtype = getattr(model, _AUTOCAST_ATTR, None)
    if dtype is None:
        yield
        return
    with torch.autocast("cpu", dtype=dtype), disable_input_dtype_casting(model):
        yield
