"""PPO's update (trainer/update/ppo.py) on a tiny llama: under torchrun on 2 gloo ranks, or in one
plain
process. tests/integration/test_ppo_update.py runs both on the same global batches and compares.

Three steps, the first a critic warm-up; two mini-batches per step, the KL in the reward under the
adaptive controller. Rank 0 saves the final actor and critic tensors and every step's metrics.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from lorarl.trainer.model.critic import (
    actor_parameters,
    add_critic,
    critic_parameters,
    critic_state_dict,
)
from lorarl.trainer.model.loading import LoraSettings, apply_lora, load_base_model, lora_state_dict
from lorarl.trainer.model.parallel import init_distributed, shard_model, shutdown_distributed
from lorarl.trainer.rl.config import KLRewardSettings
from lorarl.trainer.rl.losses import LossConfig
from lorarl.trainer.rl.samples import TrainSample
from lorarl.trainer.update.actor import UpdateConfig
from lorarl.trainer.update.batch import collate, shard_for_rank
from lorarl.trainer.update.ppo import CriticSettings, PPOConfig, PPOUpdate

LORA = LoraSettings(rank=4, alpha=8.0)
CRITIC = CriticSettings(
    lora=LoraSettings(rank=2, alpha=4.0), lr=5e-3, betas=(0.9, 0.999), weight_decay=0.0,
    warmup_steps_lr=0, scheduler="constant", grad_clip=0.5, value_clip=0.2, warmup_steps=1,
    vf_coef=1.0,
)  # fmt: skip
KL = KLRewardSettings(coef=0.05, estimator="k1", controller="adaptive", target_kl=1e-4, horizon=50)
STEPS = 3
SAMPLES = 8


def batch_samples(step: int) -> list[TrainSample]:
    """Deterministic samples of unequal prompt and completion lengths, rewards in {0, 1}."""
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(SAMPLES):
        p, c = (
            int(torch.randint(2, 6, (1,), generator=g)),
            int(torch.randint(1, 7, (1,), generator=g)),
        )
        ids = torch.randint(4, 100, (p + c,), generator=g).tolist()
        reward = float(torch.randint(0, 2, (1,), generator=g))
        out.append(TrainSample(ids[:p], ids[p:], [0.0] * c, 0.0, reward, 0))
    return out


def run(model_dir: Path, env: dict[str, str] | None) -> tuple[dict, list[dict[str, float]]]:
    ctx = init_distributed(env)
    torch.manual_seed(0)
    model = apply_lora(load_base_model(model_dir), LORA)
    add_critic(model, CRITIC.lora)
    shard_model(model, ctx)
    actor = [p for _, p in actor_parameters(model)]
    actor_opt = torch.optim.AdamW(actor, lr=5e-3)
    critic_opt = torch.optim.AdamW([p for _, p in critic_parameters(model)], lr=CRITIC.lr)
    update_cfg = UpdateConfig(loss=LossConfig(), micro_batch_size=2, mini_batches=2, grad_clip=0.5)
    ppo = PPOUpdate(model, actor_opt, critic_opt, update_cfg,
                    PPOConfig(1.0, 0.95, CRITIC, KL), actor)  # fmt: skip
    history = []
    for step in range(1, STEPS + 1):
        mine = shard_for_rank(batch_samples(step), ctx.rank, ctx.world_size)
        history.append(ppo.update(collate(mine, 0), step))
    tensors = {"actor": lora_state_dict(model), "critic": critic_state_dict(model)}
    result = {**tensors, "kl_coef": ppo.kl_coef}
    shutdown_distributed(ctx)
    return result, history


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result, history = run(args.model, None)  # torchrun's environment
    if os.environ["RANK"] == "0":
        torch.save({**result, "history": history}, args.out)
