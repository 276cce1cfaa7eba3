"""The optimizer steps of one update, shared by the actor and the critic: epochs over mini-batches,
one optimizer step per mini-batch, its gradient accumulated over micro-batches.

Each micro-batch's loss is weighted by its share of the mini-batch's *global* count (tokens or
sequences over every rank) and scaled by the world size, because FSDP averages gradients over
ranks: the gradient equals that of the whole mini-batch's loss, however it is split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lorarl.trainer.model.parallel import clip_grad_norm, set_gradient_sync
from lorarl.trainer.update.batch import TensorBatch

# A mini-batch's micro-batches: (rows in the mini-batch, loss weight; 0 for a filler).
MicroPlan = list[tuple[torch.Tensor, float]]


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over the ranks (float64, so token counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    result: list[float] = t.tolist()
    return result


def mini_batch_slices(n: int, mini_batches: int) -> list[slice]:
    """`mini_batches` contiguous, near-equal slices of `n` samples (empty ones dropped)."""
    return [
        slice(int(c[0]), int(c[-1]) + 1)
        for c in torch.arange(n).tensor_split(mini_batches)
        if len(c)
    ]


@dataclass(frozen=True)
class Micro:
    """One micro-batch as the loss sees it."""

    batch: TensorBatch  # its samples
    rows: torch.Tensor  # their rows in the step's batch
    weight: float  # 0: a filler, run only to match the other ranks' collectives
    epoch: int
    first_mini: bool  # in the first mini-batch: the weights have not moved yet this step


@dataclass(frozen=True)
class Objective:
    """What one model part (actor or critic) trains on: its global normalizer per mini-batch
    (a collective), its micro-batch plan, and its loss, which returns (loss, count) with `count`
    in the normalizer's unit and records its own metrics."""

    denominator: Callable[[TensorBatch], float]
    plan: Callable[[TensorBatch, slice], MicroPlan]
    loss: Callable[[Micro], tuple[torch.Tensor, float]]


def gradient_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    grad_clip: float,
    batch: TensorBatch,
    objective: Objective,
    *,
    mini_batches: int,
    epochs: int,
) -> list[float]:
    """Train `params` on `batch` for `epochs` x `mini_batches` optimizer steps; returns each
    step's gradient norm (before clipping). Collective: every rank runs the same steps."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    minis = mini_batch_slices(len(batch), mini_batches)
    norms: list[float] = []
    for epoch in range(epochs):
        for mini in minis:
            part = batch.slice(mini)
            denominator = objective.denominator(part)
            micros = objective.plan(part, mini)
            optimizer.zero_grad(set_to_none=True)
            for i, (rows, weight) in enumerate(micros):
                set_gradient_sync(model, i == len(micros) - 1)
                idx = rows + mini.start  # these samples' rows in `batch`
                micro = Micro(batch.take(idx), idx, weight, epoch, mini is minis[0])
                loss, count = objective.loss(micro)
                share = weight * count / denominator
                (loss * share * world).backward()
            norms.append(float(clip_grad_norm(params, grad_clip)))
            optimizer.step()
    set_gradient_sync(model, True)
    return norms
