"""Trainer memory features: activation checkpointing per decoder layer and FSDP2's CPU offload of
the frozen base (trainer.activationCheckpointing, trainer.fsdp.offloadParams).

Activation checkpointing keeps only each decoder layer's input during the forward and recomputes
the layer in the backward: the activations held for the backward shrink from every layer's
intermediates (attention, MLP: ~10-20x the hidden state per token) to one hidden state per layer,
for about one extra forward of compute. It is applied by replacing each layer's `forward` on the
instance with a non-reentrant `torch.utils.checkpoint` of the original one:

- parameter names do not change (torch's `checkpoint_wrapper` would insert
  `_checkpoint_wrapped_module.` into every name, and the adapter's names are what sync and
  checkpoints key on);
- the module's hooks stay outside the checkpoint: FSDP2's `fully_shard` gathers the layer's
  shards in a forward pre-hook, and its pre-backward hook gathers them again for the recompute;
- non-reentrant, so the frozen embedding output needs no `requires_grad` (PEFT's
  `enable_input_require_grads` exists for the reentrant variant only) and keyword arguments
  (position embeddings, masks) pass through;
- it needs no `model.train()`: Hugging Face's own switch only acts in training mode, which
  would also turn on attention dropout for models whose config sets it.

Without grad (the logprob and reference passes) the layer runs as is.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.utils.checkpoint import checkpoint

from lorarl.trainer.model.parallel import decoder_layers

_CHECKPOINTED = "_lorarl_checkpointed"


def activation_checkpointing_on(setting: bool | None, device: torch.device) -> bool:
    """trainer.activationCheckpointing resolved: unset means on for GPU trainers (activations
    dominate a long-sequence update there) and off on CPU (memory is rarely the limit; the
    recompute costs ~1/3 more update time)."""
    return device.type == "cuda" if setting is None else setting


def _checkpointed_forward(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: nn.Module) -> int:
    """Checkpoint every decoder layer's forward; returns how many. Call it before or after
    `fully_shard` (the hooks stay outside either way); calling it twice is a no-op."""
    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer, _CHECKPOINTED, False):
            continue
        layer.forward = functools.partial(_checkpointed_forward, layer.forward)
        setattr(layer, _CHECKPOINTED, True)
    return len(layers)


def is_checkpointed(layer: nn.Module) -> bool:
    return bool(getattr(layer, _CHECKPOINTED, False))


def checkpointing_summary(model: nn.Module) -> tuple[int, int]:
    """(checkpointed decoder layers, all decoder layers)."""
    layers = decoder_layers(model)
    return sum(is_checkpointed(layer) for layer in layers), len(layers)


def offload_policy(offload_params: bool, device: torch.device) -> OffloadPolicy:
    """The offload policy `fully_shard` gets (trainer.fsdp.offloadParams).

    On: FSDP2's `CPUOffloadPolicy`: every sharded parameter (the frozen base and LoRA) and its
    gradient live in pinned host memory; each layer's shards are copied to the GPU for its
    all-gather and freed after, and the optimizer steps on the host (its state lives there too:
    LoRA's is small). Off: everything stays on the device. GPU only: a CPU trainer's parameters
    are already in host memory, so the spec refuses it there and so does this.
    """
    if not offload_params:
        return OffloadPolicy()
    if device.type != "cuda":
        raise ValueError(
            "trainer.fsdp.offloadParams needs GPU trainers (gpusPerReplica > 0): on CPU the "
            "parameters are already in host memory"
        )
    return CPUOffloadPolicy(pin_memory=True)
