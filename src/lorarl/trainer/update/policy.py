"""The policy a trainer updates: the LoRA-wrapped, sharded model, its optimizers and the update
settings, built in one place so the training loop only drives them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from peft import PeftModel
from transformers import PreTrainedModel

from lorarl.api.resource import LoRARLJob
from lorarl.trainer.model.critic import actor_parameters, add_critic, critic_parameters
from lorarl.trainer.model.loading import apply_lora, lora_settings
from lorarl.trainer.model.logprobs import snapshot_lora
from lorarl.trainer.model.memory import (
    activation_checkpointing_on,
    checkpoint_layers,
    offload_policy,
)
from lorarl.trainer.model.parallel import DistContext, shard_model
from lorarl.trainer.model.precision import cpu_lora_autocast_dtype, set_lora_autocast
from lorarl.trainer.rl.config import loss_config
from lorarl.trainer.update.actor import UpdateConfig
from lorarl.trainer.update.ppo import PPOConfig, PPOUpdate, ppo_config

log = logging.getLogger(__name__)


@dataclass
class Policy:
    model: PeftModel
    optimizer: torch.optim.Optimizer
    update_cfg: UpdateConfig
    kl_reference: dict[str, torch.Tensor] | None  # None: the base model
    ppo_cfg: PPOConfig | None = None  # ppo only, as the two below
    critic_optimizer: torch.optim.Optimizer | None = None
    ppo: PPOUpdate | None = None


def mini_batches(job: LoRARLJob) -> int:
    t, g = job.spec.training, job.spec.algorithm.group_size
    return 1 if t.mini_batch_size is None else t.prompts_per_step * g // t.mini_batch_size


def build_policy(job: LoRARLJob, base: PreTrainedModel, ctx: DistContext) -> Policy:
    spec = job.spec
    model = apply_lora(base, lora_settings(job))
    ppo_cfg = ppo_config(job)  # None unless algorithm.name is ppo
    if ppo_cfg is not None:  # the critic: a second adapter + value head, same base
        add_critic(model, ppo_cfg.critic.lora)
    mixed = spec.trainer.fsdp.mixed_precision
    if activation_checkpointing_on(spec.trainer.activation_checkpointing, ctx.device):
        n = checkpoint_layers(model)
        log.info("activation checkpointing on %d decoder layers", n)
    offload = offload_policy(spec.trainer.fsdp.offload_params, ctx.device)
    shard_model(model, ctx, mixed_precision=mixed, offload=offload)
    set_lora_autocast(model, cpu_lora_autocast_dtype(model, ctx.device, mixed))
    kl_reference = None
    if spec.algorithm.kl.reference == "initialAdapter":
        kl_reference = snapshot_lora(model)
    o = spec.optim
    actor = [p for _, p in actor_parameters(model)]
    optimizer = torch.optim.AdamW(
        actor, lr=o.lr, betas=adam_betas(o.betas), weight_decay=o.weight_decay
    )
    update_cfg = UpdateConfig(
        loss=loss_config(job),
        micro_batch_size=spec.training.micro_batch_size,
        mini_batches=mini_batches(job),
        epochs=spec.algorithm.ppo_epochs,
        grad_clip=o.grad_clip,
        behavior_from_rollout=spec.training.off_policy_steps > 0,
        temperature=spec.rollout.sampling.temperature,
        max_tokens=spec.training.max_tokens_per_micro_batch,
    )
    policy = Policy(model, optimizer, update_cfg, kl_reference, ppo_cfg)
    if ppo_cfg is not None:
        c = ppo_cfg.critic
        policy.critic_optimizer = torch.optim.AdamW(
            [p for _, p in critic_parameters(model)],
            lr=c.lr, betas=adam_betas(c.betas), weight_decay=c.weight_decay,
        )  # fmt: skip
        policy.ppo = PPOUpdate(
            model, optimizer, policy.critic_optimizer, update_cfg, ppo_cfg, actor
        )
    return policy


def adam_betas(betas: Sequence[float]) -> tuple[float, float]:
    """The spec's two-item list (validated there) as the pair AdamW takes."""
    beta1, beta2 = betas
    return beta1, beta2
