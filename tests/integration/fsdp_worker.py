"""torchrun worker for tests/integration/test_fsdp_lora.py: FSDP2 + LoRA training and resume.

`train`: shard a tiny llama with LoRA, run STEPS_BEFORE_SAVE optimizer steps (2 micro-batches
each, gradient sync only on the last), checkpoint, export the adapter, run one more step.
`resume`: fresh process group, fresh LoRA init, load the newest checkpoint, run that same last step;
then `kl.reference: initialAdapter` as the trainer runs it: a second model started from the exported
adapter, sharded, snapshotted (`snapshot_lora`), trained one step, scored by the reference pass.
Rank 0 writes what the test compares into --out. The batch/objective helpers are imported by the
test to replay the same training in one plain process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from lorarl.trainer.checkpoint.manager import CheckpointManager, export_adapter
from lorarl.trainer.model.loading import (
    LoraSettings,
    apply_lora,
    load_base_model,
    lora_parameters,
    lora_state_dict,
)
from lorarl.trainer.model.logprobs import (
    adapter_reference_logprobs,
    reference_logprobs,
    sequence_logprobs,
    snapshot_lora,
)
from lorarl.trainer.model.parallel import (
    clip_grad_norm,
    init_distributed,
    set_gradient_sync,
    shard_model,
)

LORA = LoraSettings(rank=4, alpha=8.0, target_modules="all-linear")
STEPS_BEFORE_SAVE = 2
MICRO_BATCHES = 2
MICRO_BATCH_SIZE = 2
SEQ_LEN = 16
PROMPT_LEN = 6
LR = 5e-3
MAX_GRAD_NORM = 0.05  # small enough that clipping really happens
INIT_SEED = 1234


def make_batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, ...]:
    """Deterministic per (step, rank, micro) batch; the first row is left-padded by 2."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    ids = torch.randint(4, 100, (MICRO_BATCH_SIZE, SEQ_LEN), generator=g)
    attn = torch.ones_like(ids)
    ids[0, :2], attn[0, :2] = 0, 0
    resp = torch.zeros_like(ids)
    resp[:, PROMPT_LEN:] = 1
    return ids, attn, resp


def probe_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(999)
    ids = torch.randint(4, 100, (2, SEQ_LEN), generator=g)
    return ids, torch.ones_like(ids)


def micro_loss(model: torch.nn.Module, step: int, rank: int, micro: int) -> torch.Tensor:
    """Stand-in objective: negative mean response logprob, scaled for accumulation."""
    ids, attn, resp = make_batch(step, rank, micro)
    lp, _ = sequence_logprobs(model, ids, attn, resp, micro_batch_size=MICRO_BATCH_SIZE)
    return -(lp.sum() / resp.sum()) / MICRO_BATCHES


def train_step(model, optimizer, step: int, rank: int) -> float:
    """One optimizer step under FSDP2 (or plain, world 1). Returns the pre-clip grad norm."""
    ids, attn, resp = make_batch(step, rank, 0)
    reference_logprobs(model, ids, attn, resp, micro_batch_size=MICRO_BATCH_SIZE)  # as RL does
    for micro in range(MICRO_BATCHES):
        set_gradient_sync(model, micro == MICRO_BATCHES - 1)
        micro_loss(model, step, rank, micro).backward()
    norm = clip_grad_norm([p for _, p in lora_parameters(model)], MAX_GRAD_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=LR, weight_decay=0.01)


def full_base_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: unsharded copies of every non-LoRA parameter, in a fixed order."""
    out = {}
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def reference_batch() -> tuple[torch.Tensor, ...]:
    """The batch the initialAdapter reference is scored on (the same on both ranks)."""
    return make_batch(99, 0, 0)


def initial_adapter_reference(model_dir: str, adapter: Path, ctx, out: Path) -> None:
    """What the trainer does for `kl.reference: initialAdapter`, under FSDP2: start from
    `adapter`, snapshot its (sharded) tensors, move the policy, then score the reference batch
    with the snapshot swapped in. Rank 0 saves reference, base and policy logprobs."""
    torch.manual_seed(INIT_SEED)
    settings = dataclasses.replace(LORA, adapter_path=str(adapter))
    model = shard_model(apply_lora(load_base_model(model_dir), settings), ctx, mixed_precision=True)
    snapshot = snapshot_lora(model)
    optimizer = make_optimizer(model)
    train_step(model, optimizer, 0, ctx.rank)  # the policy leaves the initial adapter
    ids, attn, resp = reference_batch()
    kw = {"micro_batch_size": MICRO_BATCH_SIZE}
    with torch.no_grad():
        policy_before, _ = sequence_logprobs(model, ids, attn, resp, **kw)
        ref = adapter_reference_logprobs(model, snapshot, ids, attn, resp, **kw)
        base = reference_logprobs(model, ids, attn, resp, **kw)
        policy_after, _ = sequence_logprobs(model, ids, attn, resp, **kw)
    if ctx.rank == 0:
        torch.save(
            {"reference": ref, "base": base, "policy": policy_before, "policy_after": policy_after},
            out / "initial_adapter_reference.pt",
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "resume"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)

    ctx = init_distributed()
    assert ctx.world_size == 2 and ctx.backend == "gloo", ctx
    torch.manual_seed(INIT_SEED if args.mode == "train" else INIT_SEED + 1)
    peft_model = apply_lora(load_base_model(args.model), LORA)
    base_before = {
        n: p.detach().clone() for n, p in peft_model.named_parameters() if ".lora_" not in n
    }
    model = shard_model(peft_model, ctx, mixed_precision=True)
    assert all(hasattr(p, "device_mesh") for p in model.parameters()), "not sharded"
    optimizer = make_optimizer(model)
    manager = CheckpointManager(args.ckpt, keep_last=1)
    result: dict = {"rank": ctx.rank}

    if args.mode == "train":
        torch.manual_seed(77 + ctx.rank)  # distinct per-rank RNG streams for the checkpoint
        lora_init = lora_state_dict(model)
        norms = [train_step(model, optimizer, s, ctx.rank) for s in range(STEPS_BEFORE_SAVE)]
        result["norms"] = norms
        trained = lora_state_dict(model)
        result["lora_changed"] = {k: not torch.equal(trained[k], lora_init[k]) for k in trained}
        base_after = full_base_params(model)
        result["base_unchanged"] = all(
            torch.equal(base_after[k], base_before[k]) for k in base_before
        )
        manager.save(STEPS_BEFORE_SAVE, model, optimizer, {"data_position": 123})
        export_adapter(model, out / "exported")
        result["rand_after_ckpt"] = torch.rand(3).tolist()
        ids, attn = probe_batch()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attn).logits
        if ctx.rank == 0:
            save_file(trained, str(out / "trained.safetensors"))
            torch.save(logits, out / "probe_logits.pt")
    else:
        ckpt = manager.latest_shared()
        assert ckpt is not None, "no checkpoint found"
        loaded = manager.load(ckpt, model, optimizer)
        result["loaded_step"] = loaded.step
        result["trainer_state"] = loaded.trainer_state
        result["rand_after_ckpt"] = torch.rand(3).tolist()
        restored = lora_state_dict(model)
        if ctx.rank == 0:
            save_file(restored, str(out / "restored.safetensors"))

    train_step(model, optimizer, STEPS_BEFORE_SAVE, ctx.rank)
    final = lora_state_dict(model)
    if ctx.rank == 0:
        save_file(final, str(out / f"{args.mode}_final.safetensors"))
    if args.mode == "resume":
        initial_adapter_reference(args.model, out / "exported", ctx, out)
    (out / f"{args.mode}_rank{ctx.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
