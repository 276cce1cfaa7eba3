"""torchrun worker for tests/integration/test_update_skip.py: two FSDP2 ranks whose batches hold
different numbers of samples with no advantage, so each rank has a different number of
micro-batches to train; the update must still run the same collectives on both (no hang) and
end at the weights the unskipped update reaches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import lorarl.trainer.update.actor as update_module
from lorarl.trainer.model.loading import LoraSettings, apply_lora, load_base_model, lora_state_dict
from lorarl.trainer.model.parallel import init_distributed, shard_model
from lorarl.trainer.rl.losses import LossConfig
from lorarl.trainer.rl.samples import TrainSample
from lorarl.trainer.update.batch import collate

ADVANTAGES = {  # rank -> per-sample advantages: rank 0 trains 2 samples, rank 1 all 6
    0: [0.0, 0.0, 1.0, 0.0, -1.0, 0.0],
    1: [0.5, -0.5, 1.0, -1.0, 0.25, -0.25],
}


def batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    samples = []
    for i, adv in enumerate(ADVANTAGES[rank]):
        n = 6 + (i * 3) % 5
        ids = torch.randint(4, 100, (n,), generator=g).tolist()
        samples.append(TrainSample(ids[:3], ids[3:], [-1.0] * (n - 3), adv, 0.0, 0))
    return collate(samples, pad_id=0)


def trained(model_dir: str, ctx, skipping: bool) -> tuple[dict, dict]:
    """(LoRA tensors before, after) one update; SGD at lr 1, so the move is the gradient."""
    torch.manual_seed(7)
    model = apply_lora(load_base_model(model_dir), LoraSettings(rank=4, alpha=8.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model = shard_model(model, ctx, mixed_precision=True)
    before = {n: t.clone() for n, t in lora_state_dict(model).items()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    original = update_module.gradient_free
    if not skipping:
        update_module.gradient_free = lambda b, c: None
    try:
        cfg = update_module.UpdateConfig(LossConfig(), micro_batch_size=2)
        update_module.update_policy(model, opt, batch(ctx.rank), cfg)
    finally:
        update_module.gradient_free = original
    return before, lora_state_dict(model)


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    ctx = init_distributed()
    assert ctx.world_size == 2, ctx
    (_, skipped), (before, full) = trained(model_dir, ctx, True), trained(model_dir, ctx, False)
    if ctx.rank == 0:
        gaps = {n: float((skipped[n] - full[n]).abs().max()) for n in full}
        moved = max(float((full[n] - before[n]).abs().max()) for n in full)
        out.write_text(json.dumps({"max_gap": max(gaps.values()), "tensors": len(gaps),
                                   "moved": moved}))  # fmt: skip


if __name__ == "__main__":
    main()
