"""torchrun worker for tests/integration/test_fsdp_memory.py: one policy update under 2-rank FSDP2
(gloo) with activation checkpointing on every decoder layer and micro-batches cut by a token
budget, the two ranks holding samples of very different lengths (so they pack into different
numbers of micro-batches and must be balanced). Rank 0 writes the full LoRA gradients and every
rank its forward shapes; the test replays the update in one plain process, without either
feature, and compares.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lorarl.trainer.model.loading import LoraSettings, apply_lora, load_base_model, lora_parameters
from lorarl.trainer.model.memory import checkpoint_layers, checkpointing_summary
from lorarl.trainer.model.parallel import init_distributed, shard_model
from lorarl.trainer.rl.losses import LossConfig
from lorarl.trainer.rl.samples import TrainSample
from lorarl.trainer.update.actor import UpdateConfig, update_policy
from lorarl.trainer.update.batch import collate

LORA = LoraSettings(rank=4, alpha=8.0, target_modules="all-linear")
INIT_SEED = 99
MAX_TOKENS = 24
MICRO_BATCH_SIZE = 8
# rank 0: short samples (pack several to a micro-batch); rank 1: long ones (one or two each)
LENGTHS = ([5, 6, 5, 6, 7, 5], [12, 13, 11, 14, 12, 10])
LOSS = LossConfig(kl_coef=0.1)  # a reference pass too, also cut by the budget


def samples(rank: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for i, n in enumerate(LENGTHS[rank]):
        ids = torch.randint(4, 60, (n,), generator=g).tolist()
        adv = (1.0, -1.0, 0.5)[i % 3] * (1 if rank == 0 else -1)
        out.append(TrainSample(ids[:3], ids[3:], [-1.5] * (n - 3), adv, 0.0, 0))
    return out


def make_policy(model_dir: str):
    torch.manual_seed(INIT_SEED)
    model = apply_lora(load_base_model(model_dir), LORA)
    g = torch.Generator().manual_seed(INIT_SEED)
    with torch.no_grad():  # non-zero B so A gets gradients and the KL is not 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def config(max_tokens: int | None, micro_batch_size: int) -> UpdateConfig:
    return UpdateConfig(
        LOSS, micro_batch_size=micro_batch_size, grad_clip=1e9, max_tokens=max_tokens
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    ctx = init_distributed()
    assert ctx.world_size == 2 and ctx.backend == "gloo", ctx
    model = make_policy(args.model)
    checkpoint_layers(model)
    shard_model(model, ctx, mixed_precision=True)
    shapes: list[list[int]] = []
    mlp_calls: list[int] = []
    model.get_base_model().model.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(list(kw["input_ids"].shape)), with_kwargs=True
    )
    model.get_base_model().model.layers[0].mlp.register_forward_pre_hook(
        lambda *_: mlp_calls.append(1)
    )
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    batch = collate(samples(ctx.rank), pad_id=0)
    metrics = update_policy(model, opt, batch, config(MAX_TOKENS, MICRO_BATCH_SIZE))
    grads = {n: p.grad.full_tensor() for n, p in lora_parameters(model)}
    result = {
        "rank": ctx.rank,
        "shapes": shapes,
        "mlp_calls": len(mlp_calls),
        "checkpointed": list(checkpointing_summary(model)),
        "loss": metrics["loss"],
    }
    if ctx.rank == 0:
        torch.save(grads, out / "grads.pt")
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
