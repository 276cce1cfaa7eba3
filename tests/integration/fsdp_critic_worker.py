"""torchrun worker for tests/integration/test_fsdp_critic.py: the PPO critic under FSDP2.

One launch, two gloo ranks: shard a tiny llama with the actor adapter, the critic adapter and the
value head; record values, value-loss gradients and actor logprobs on fixed per-rank batches (the
test recomputes them in one plain process); train TRAIN_STEPS PPO-shaped steps (reference pass,
critic step, actor step, two optimizers), checkpoint, take one more step; then a freshly built and
sharded model loads the checkpoint and takes the same step. Rank 0 writes everything to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from lorarl.trainer.checkpoint.export import export_critic
from lorarl.trainer.checkpoint.manager import CheckpointManager
from lorarl.trainer.model.critic import (
    actor_parameters,
    add_critic,
    critic_parameters,
    critic_state_dict,
    sequence_values,
)
from lorarl.trainer.model.loading import LoraSettings, apply_lora, load_base_model, lora_state_dict
from lorarl.trainer.model.logprobs import reference_logprobs, sequence_logprobs
from lorarl.trainer.model.parallel import (
    clip_grad_norm,
    init_distributed,
    set_gradient_sync,
    shard_model,
)

LORA = LoraSettings(rank=4, alpha=8.0)
CRITIC_LORA = LoraSettings(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj", "up_proj"])
WORLD = 2
MICRO_BATCH_SIZE = 2
BATCH = 4  # per rank: two micro-batches
SEQ_LEN = 12
PROMPT_LEN = 5
TRAIN_STEPS = 2
LR = 5e-3
INIT_SEED = 4321


def make_batch(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Per (step, rank): the first row left-padded by 2, the second a shorter completion."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(4, 100, (BATCH, SEQ_LEN), generator=g)
    attn = torch.ones_like(ids)
    ids[0, :2], attn[0, :2] = 0, 0
    resp = torch.zeros_like(ids)
    resp[:, PROMPT_LEN:] = 1
    resp[1, -3:] = 0
    return ids, attn, resp


def targets(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + 1000 * step + rank)
    return torch.rand(BATCH, SEQ_LEN, generator=g)


def randomise(params: list[tuple[str, torch.nn.Parameter]], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def build(model_dir: str, seed: int, critic: bool = True) -> torch.nn.Module:
    """The same tensors on every rank (and in the test's plain process) for a given seed."""
    torch.manual_seed(seed)
    model = apply_lora(load_base_model(model_dir), LORA)
    randomise(actor_parameters(model), seed + 1)
    if critic:
        add_critic(model, CRITIC_LORA)
        randomise(critic_parameters(model), seed + 2)
    return model


def value_loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    ids, attn, resp = make_batch(step, rank)
    v = sequence_values(model, ids, attn, resp, micro_batch_size=MICRO_BATCH_SIZE)
    return ((v - targets(step, rank)) ** 2 * resp).sum() / resp.sum()


def actor_loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    ids, attn, resp = make_batch(step, rank)
    lp, _ = sequence_logprobs(model, ids, attn, resp, micro_batch_size=MICRO_BATCH_SIZE)
    return -(lp.sum() / resp.sum())


def optimizers(model) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    actor = torch.optim.AdamW([p for _, p in actor_parameters(model)], lr=LR)
    critic = torch.optim.AdamW([p for _, p in critic_parameters(model)], lr=LR)
    return actor, critic


def ppo_step(model, actor_opt, critic_opt, step: int, rank: int) -> None:
    """The shape of one PPO update: reference pass, critic step, then actor step."""
    ids, attn, resp = make_batch(step, rank)
    reference_logprobs(model, ids, attn, resp, micro_batch_size=MICRO_BATCH_SIZE)
    set_gradient_sync(model, True)
    value_loss(model, step, rank).backward()
    clip_grad_norm([p for _, p in critic_parameters(model)], 1.0)
    critic_opt.step()
    critic_opt.zero_grad(set_to_none=True)
    actor_loss(model, step, rank).backward()
    clip_grad_norm([p for _, p in actor_parameters(model)], 1.0)
    actor_opt.step()
    actor_opt.zero_grad(set_to_none=True)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def fingerprint(model, actor_opt, critic_opt) -> dict[str, torch.Tensor]:
    """Collective: actor + critic + head tensors and both optimizers' full states."""
    out = {f"actor/{k}": v for k, v in lora_state_dict(model).items()}
    out |= {f"critic/{k}": v for k, v in critic_state_dict(model).items()}
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for tag, opt in (("actor_opt", actor_opt), ("critic_opt", critic_opt)):
        state = get_optimizer_state_dict(model, opt, options=opts).get("state", {})  # rank 0
        for name, entry in state.items():
            for key, value in entry.items():
                out[f"{tag}/{name}/{key}"] = torch.as_tensor(value).clone()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    ctx = init_distributed()
    assert ctx.world_size == WORLD and ctx.backend == "gloo", ctx
    rank = ctx.rank
    model = shard_model(build(args.model, INIT_SEED), ctx)
    assert all(hasattr(p, "device_mesh") for p in model.parameters()), "not sharded"
    result: dict[str, object] = {}

    ids, attn, resp = make_batch(0, rank)
    with torch.no_grad():
        values = sequence_values(model, ids, attn, resp, micro_batch_size=MICRO_BATCH_SIZE)
        logprobs, _ = sequence_logprobs(model, ids, attn, resp, micro_batch_size=MICRO_BATCH_SIZE)
    gathered: list[object] = [None] * WORLD
    dist.all_gather_object(gathered, {"values": values, "logprobs": logprobs})
    result["per_rank"] = gathered

    value_loss(model, 0, rank).backward()  # FSDP2 averages the ranks' gradients
    result["critic_grads"] = {n: full(p.grad) for n, p in critic_parameters(model)}
    result["actor_grads_none"] = all(p.grad is None for _, p in actor_parameters(model))
    model.zero_grad(set_to_none=True)

    actor_opt, critic_opt = optimizers(model)
    result["initial"] = {f"actor/{k}": v for k, v in lora_state_dict(model).items()}
    result["initial"] |= {f"critic/{k}": v for k, v in critic_state_dict(model).items()}
    for step in range(TRAIN_STEPS):
        ppo_step(model, actor_opt, critic_opt, step, rank)
    manager = CheckpointManager(out / "ckpt", keep_last=1)
    path = manager.save(TRAIN_STEPS, model, actor_opt, {"pos": 7}, critic_optimizer=critic_opt)
    export_critic(model, out / "critic")
    with torch.no_grad():
        result["trained_values"] = sequence_values(
            model, ids, attn, resp, micro_batch_size=MICRO_BATCH_SIZE
        )
    result["at_save"] = fingerprint(model, actor_opt, critic_opt)
    ppo_step(model, actor_opt, critic_opt, TRAIN_STEPS, rank)
    result["uninterrupted"] = fingerprint(model, actor_opt, critic_opt)

    fresh = shard_model(build(args.model, INIT_SEED + 100), ctx)
    fresh_actor, fresh_critic = optimizers(fresh)
    loaded = manager.load(path, fresh, fresh_actor, fresh_critic)
    result["loaded"] = {"step": loaded.step, "state": loaded.trainer_state}
    ppo_step(fresh, fresh_actor, fresh_critic, TRAIN_STEPS, rank)
    result["resumed"] = fingerprint(fresh, fresh_actor, fresh_critic)
    if rank == 0:
        torch.save(result, out / "results.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
