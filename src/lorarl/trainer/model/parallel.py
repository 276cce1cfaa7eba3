"""Process group setup and FSDP2 sharding of a PEFT model.

The same code runs under torchrun on GPUs (NCCL for CUDA tensors, gloo for CPU ones) and on CPU
(gloo), and as a single plain process
(no process group at all) so unit tests and tiny local runs need no launcher.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from lorarl.trainer.model.critic import CRITIC_FORWARD, VALUE_HEAD

log = logging.getLogger(__name__)

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: single process, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def _env_int(env: dict[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(
            f"environment variable {name} must be an integer, got {env[name]!r}"
        ) from None


# Two backends in one group: NCCL for CUDA tensors (FSDP's collectives), gloo for CPU tensors
# (the loop's token counts and metrics, object collectives, barriers). An NCCL-only group rejects
# a CPU tensor: "No backend type associated with device type cpu".
GPU_BACKEND = "cpu:gloo,cuda:nccl"
CPU_BACKEND = "gloo"


def placement(cuda: bool, local_rank: int) -> tuple[torch.device, str]:
    """(this rank's device, the process group's backend string): pure, so it is unit-tested."""
    if cuda:
        return torch.device("cuda", local_rank), GPU_BACKEND
    return torch.device("cpu"), CPU_BACKEND


def init_distributed(env: dict[str, str] | None = None) -> DistContext:
    """Join the torchrun process group, or fall back to one plain process when torchrun is absent.

    All five torchrun variables must be present together: a partial set means a broken launch
    (e.g. a pod template missing MASTER_ADDR) and silently training alone would hide it.
    """
    env = dict(os.environ) if env is None else env
    present = [k for k in TORCHRUN_ENV if k in env]
    cuda = torch.cuda.is_available()
    if not present:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        return DistContext(0, 1, 0, device, None)
    missing = [k for k in TORCHRUN_ENV if k not in env]
    if missing:
        raise RuntimeError(
            f"incomplete torchrun environment: {', '.join(missing)} missing "
            f"(have {', '.join(present)})"
        )
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    local_rank = _env_int(env, "LOCAL_RANK")
    if not 0 <= rank < world:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE={world}), got {rank}")
    device, backend = placement(cuda, local_rank)
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    return DistContext(rank, world, local_rank, device, backend)


def shutdown_distributed(ctx: DistContext, barrier: bool = False) -> None:
    if ctx.distributed and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


LAYER_LIST_NAMES = ("layers", "h", "blocks")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a (PEFT-wrapped) HF causal LM: FSDP2's sharding units."""
    for name, module in model.named_modules():
        is_list = isinstance(module, nn.ModuleList) and len(module) > 0
        if is_list and name.rsplit(".", 1)[-1] in LAYER_LIST_NAMES:
            return list(module)
    raise ValueError(
        f"cannot find decoder layers in {type(model).__name__}: "
        f"expected a ModuleList named one of {LAYER_LIST_NAMES}"
    )


def compute_dtype(ctx: DistContext, mixed_precision: bool) -> torch.dtype | None:
    """The dtype the trainer computes in when it is not the parameters' own (None): bf16 under
    FSDP2 mixed precision, which `shard_model` applies on GPU only. The weight sync ships the
    adapter in it too (`trainer/fleet/publish.py`)."""
    if mixed_precision and ctx.distributed and ctx.device.type == "cuda":
        return torch.bfloat16
    return None


def shard_model(
    model: nn.Module,
    ctx: DistContext,
    mixed_precision: bool = True,
    offload: OffloadPolicy | None = None,
) -> nn.Module:
    """Apply FSDP2 per decoder layer (and PPO's value head), then at the root; a no-op for a
    single plain process.

    `offload`: the policy every unit gets (`memory.offload_policy`, trainer.fsdp.offloadParams);
    a CPU offload needs the sharded path, so a single plain process refuses it.

    `reshard_after_forward` stays True on purpose: PEFT's `disable_adapter()` toggles
    `requires_grad` on whatever parameters are registered, and with resharding off those are
    unsharded copies, leaving the real (sharded) LoRA weights frozen
    (docs/architecture.md#measured-facts).
    Mixed precision only on GPU: gloo has no use for bf16 compute and CPU bf16 is slow.
    """
    offload = offload if offload is not None else OffloadPolicy()
    if not ctx.distributed:
        if isinstance(offload, CPUOffloadPolicy):
            raise ValueError(
                "trainer.fsdp.offloadParams needs the trainer to run under torchrun (FSDP2 "
                "shards the model to offload it)"
            )
        return model.to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp",))
    mp = MixedPrecisionPolicy()
    if compute_dtype(ctx, mixed_precision) == torch.bfloat16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(
            layer, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=True
        )
    head = getattr(model, VALUE_HEAD, None)
    if isinstance(head, nn.Module):
        # PPO's value head runs outside the root's forward: as a root parameter it would not be
        # gathered then. Its own unit gathers it around its own call; fp32 always.
        fully_shard(
            head,
            mesh=mesh,
            mp_policy=MixedPrecisionPolicy(),
            offload_policy=offload,
            reshard_after_forward=True,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=True)
    if hasattr(model, CRITIC_FORWARD):
        # The critic's decoder-only pass needs the root's gather/reshard and backward hooks too.
        register_fsdp_forward_method(model, CRITIC_FORWARD)
    return model


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Skip the gradient reduce-scatter on non-final micro-batches (grads accumulate unsharded)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the global grad norm; works for DTensor (FSDP2) and plain grads alike.

    With sharded grads each rank only sees its slice, so the norm is a DTensor whose
    `full_tensor()` performs the cross-rank reduction — every rank must call this.
    Returns the total norm before clipping (a plain scalar tensor).
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    grads = [p.grad for p in params if p.grad is not None]  # (the filter again narrows for mypy)
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
