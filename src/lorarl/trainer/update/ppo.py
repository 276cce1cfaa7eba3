"""PPO's update on this rank: the critic's values, GAE, then the critic and the actor step
(docs/architecture.md#ppo-with-a-lora-critic).

Actor, critic and reference share one base model: the critic is a second LoRA adapter plus a value
head (trainer/model/critic.py) and the reference is the base with every adapter disabled. Everything
before the two updates is measured at the step's starting weights, as in verl: old logprobs, the
reference logprobs, old values; then token rewards (the outcome reward on the last response token,
minus beta * KL per token with `kl.inReward`), GAE advantages whitened over the whole batch and
returns. The critic trains first, then the actor (after the critic's warm-up steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from peft import PeftModel

from lorarl.api.resource import LoRARLJob
from lorarl.api.spec.critic import CriticSpec
from lorarl.trainer.model.critic import critic_parameters, sequence_values
from lorarl.trainer.model.loading import LoraSettings, lora_values
from lorarl.trainer.model.logprobs import sequence_logprobs
from lorarl.trainer.rl.advantages import gae, last_token_rewards, value_loss
from lorarl.trainer.rl.config import KLRewardSettings, kl_reward_settings
from lorarl.trainer.rl.kl_reward import KLController, kl_in_reward, per_sequence_kl
from lorarl.trainer.update.actor import (
    UpdateConfig,
    plan_micro_batches,
    reference_pass,
    rollout_mismatch_metrics,
    update_policy,
)
from lorarl.trainer.update.batch import TensorBatch
from lorarl.trainer.update.steps import (
    Micro,
    Objective,
    all_reduce_sum,
    gradient_steps,
)


@dataclass(frozen=True)
class CriticSettings:
    """spec.critic resolved: the critic adapter's shape (the actor's where unset), its own
    optimizer and the value-loss settings."""

    lora: LoraSettings
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    warmup_steps_lr: int  # the optimizer's LR warmup (critic.optim.warmupSteps)
    scheduler: str
    grad_clip: float
    value_clip: float
    warmup_steps: int  # critic-only steps before the actor moves (critic.warmupSteps)
    vf_coef: float


def critic_settings(job: LoRARLJob) -> CriticSettings:
    """The critic as the trainer builds it. Unset (spec.critic None) means every default."""
    critic = job.spec.critic or CriticSpec()
    actor, own = lora_values(job), critic.lora  # the actor's as applied (adapter included)
    targets = list(own.target_modules if own.target_modules is not None else actor.target_modules)
    return CriticSettings(
        lora=LoraSettings(
            rank=own.rank if own.rank is not None else actor.rank,
            alpha=own.alpha if own.alpha is not None else actor.alpha,
            dropout=0.0,  # never applied during RL (see spec.lora.dropout)
            target_modules="all-linear" if targets == ["all-linear"] else list(targets),
            exclude_modules=list(
                own.exclude_modules if own.exclude_modules is not None else actor.exclude_modules
            ),
            use_rslora=own.use_rslora if own.use_rslora is not None else actor.use_rslora,
            adapter_path=None,  # a fresh critic; a resumed run loads it from its checkpoint
        ),
        lr=critic.optim.lr,
        betas=(critic.optim.betas[0], critic.optim.betas[1]),
        weight_decay=critic.optim.weight_decay,
        warmup_steps_lr=critic.optim.warmup_steps,
        scheduler=critic.optim.scheduler,
        grad_clip=critic.optim.grad_clip,
        value_clip=critic.value_clip,
        warmup_steps=critic.warmup_steps,
        vf_coef=critic.vf_coef,
    )


@dataclass(frozen=True)
class PPOConfig:
    gamma: float
    lam: float
    critic: CriticSettings
    kl_reward: KLRewardSettings | None = None


def ppo_config(job: LoRARLJob) -> PPOConfig | None:
    """The job's PPO settings, defaults resolved; None for the critic-free algorithms."""
    a = job.spec.algorithm
    if a.name != "ppo":
        return None
    return PPOConfig(a.gamma, a.lam, critic_settings(job), kl_reward_settings(job))


def global_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """(count, mean, unbiased variance) of `x` over the masked tokens of every rank's batch."""
    m = mask.to(torch.float64)
    xd = x.to(torch.float64) * m
    n, s, sq = all_reduce_sum([m.sum().item(), xd.sum().item(), (xd * xd).sum().item()])
    if n < 1:
        return 0.0, 0.0, 0.0
    mean = s / n
    var = max(sq - n * mean * mean, 0.0) / max(n - 1.0, 1.0)
    return n, mean, var


def global_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`advantages.whiten` with the statistics of the whole step's batch, not this rank's share:
    ranks hold different samples, and each must scale its advantages the same way."""
    n, mean, var = global_moments(x, mask)
    if n < 2:
        return x * mask
    return (x - mean) * (var + eps) ** -0.5 * mask.to(x.dtype)


def global_explained_variance(values: torch.Tensor, returns: torch.Tensor, mask) -> float:
    """1 - Var(returns - values) / Var(returns) over every rank's masked tokens (verl's
    vf_explained_var, `advantages.explained_variance` on one rank): 0 for a critic that predicts
    the mean, 1 for a perfect one."""
    _, _, var_r = global_moments(returns, mask)
    _, _, var_d = global_moments(returns - values, mask)
    return 1.0 - var_d / (var_r + 1e-5)


def ppo_token_rewards(batch: TensorBatch) -> torch.Tensor:
    """[B, T] rewards for GAE: each sample's reward on its last response token, or, with
    per-turn rewards, each turn's on its last token and the rest of the total on the last."""
    mask, rewards = batch.response_mask, batch.rewards
    if rewards is None:
        raise ValueError("PPO needs the samples' rewards (`collate` sets them)")
    if batch.turn_rewards is None:
        return last_token_rewards(rewards, mask, allow_empty=True)
    rest = rewards - batch.turn_rewards.sum(dim=-1)
    return last_token_rewards(rest, mask, allow_empty=True) + batch.turn_rewards


class PPOUpdate:
    """The PPO part of a step; the KL controller's state goes into every checkpoint."""

    def __init__(
        self,
        model: PeftModel,
        actor_optimizer: torch.optim.Optimizer,
        critic_optimizer: torch.optim.Optimizer,
        update_cfg: UpdateConfig,
        cfg: PPOConfig,
        actor_params: list[torch.nn.Parameter],
    ) -> None:
        self.model, self.update_cfg, self.cfg = model, update_cfg, cfg
        self.actor_optimizer, self.critic_optimizer = actor_optimizer, critic_optimizer
        self.actor_params = actor_params
        self.critic_params = [p for _, p in critic_parameters(model)]
        kl = cfg.kl_reward
        self.kl_controller = (
            KLController(kl.coef, kl.controller, target_kl=kl.target_kl, horizon=kl.horizon)
            if kl
            else None
        )

    @property
    def kl_coef(self) -> float | None:
        """The in-reward KL coefficient the next step uses (None without kl.inReward)."""
        return None if self.kl_controller is None else float(self.kl_controller.value)

    def state_dict(self) -> dict:
        return {"kl_controller": self.kl_controller.state_dict() if self.kl_controller else None}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("kl_controller")
        if self.kl_controller is not None and saved is not None:
            self.kl_controller.load_state_dict(saved)

    def update(
        self,
        batch: TensorBatch,
        step: int,
        reference: dict[str, torch.Tensor] | None = None,
        replicas: int = 0,
    ) -> dict[str, float]:
        """Train critic then actor on this rank's share of `step`'s samples; returns metrics.
        `replicas`: the step's engine count, for the per-engine mismatch (`update_policy`)."""
        cfg, ucfg, mask = self.cfg, self.update_cfg, batch.response_mask
        mbs, max_tokens = ucfg.micro_batch_size, ucfg.max_tokens
        with torch.no_grad():
            old_lp, _ = sequence_logprobs(
                self.model, batch.input_ids, batch.attention_mask, mask,
                temperature=ucfg.temperature, micro_batch_size=mbs, max_tokens=max_tokens,
            )  # fmt: skip
            old_values = sequence_values(
                self.model, batch.input_ids, batch.attention_mask, mask,
                micro_batch_size=mbs, max_tokens=max_tokens,
            )  # fmt: skip
        needs_ref = self.kl_controller is not None or ucfg.loss.kl_coef > 0
        ref_lp = reference_pass(self.model, batch, ucfg, reference) if needs_ref else None
        token_rewards = ppo_token_rewards(batch)
        metrics: dict[str, float] = {}
        kl = cfg.kl_reward  # set exactly when there is a controller; then `needs_ref` is true
        if self.kl_controller is not None and kl is not None and ref_lp is not None:
            beta = self.kl_controller.value
            token_rewards, kl_tok = kl_in_reward(
                token_rewards, old_lp, ref_lp, mask, beta, kl.estimator
            )
            kl_now, n_seqs = self._global_current_kl(kl_tok, mask)
            self.kl_controller.update(kl_now, n_seqs)
            metrics.update(kl_coef=beta, kl_in_reward=kl_now)
        advantages, returns = gae(token_rewards, old_values, mask, cfg.gamma, cfg.lam)
        advantages = global_whiten(advantages, mask)
        _, value_mean, _ = global_moments(old_values, mask)
        metrics.update(
            explained_variance=global_explained_variance(old_values, returns, mask),
            value_mean=value_mean,
        )
        metrics.update(self._update_critic(batch, old_values, returns))
        if step > cfg.critic.warmup_steps:
            batch.token_advantages = advantages
            metrics.update(update_policy(
                self.model, self.actor_optimizer, batch, ucfg, reference,
                params=self.actor_params, old_logprobs=old_lp, ref_logprobs=ref_lp,
                replicas=replicas,
            ))  # fmt: skip
        else:  # the actor waits for a critic worth following: its weights stay as they are
            metrics.update(rollout_mismatch_metrics(batch, old_lp, replicas))
        return metrics

    def _global_current_kl(self, kl_tok: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
        """verl's current_kl (mean over sequences of each one's token-mean KL) over all ranks."""
        means, rows = per_sequence_kl(kl_tok, mask)
        total, count = all_reduce_sum([float(means[rows].sum()), float(rows.sum())])
        return (total / count if count else 0.0), int(count)

    def _critic_micro_batches(self, mini: TensorBatch) -> list[tuple[torch.Tensor, float]]:
        """(rows in `mini`, loss weight): in order by microBatchSize, or by the token budget
        (`update.plan_micro_batches`, every row: the value loss has no gradient-free rows)."""
        ucfg = self.update_cfg
        if ucfg.max_tokens is not None:
            return plan_micro_batches(mini, None, ucfg)
        n = len(mini)
        return [(torch.arange(s, min(s + ucfg.micro_batch_size, n)), 1.0)
                for s in range(0, n, ucfg.micro_batch_size)]  # fmt: skip

    def _update_critic(
        self, batch: TensorBatch, old_values: torch.Tensor, returns: torch.Tensor
    ) -> dict[str, float]:
        ucfg, crit = self.update_cfg, self.cfg.critic
        sums = {"tokens": 0.0, "loss": 0.0, "clip": 0.0}

        def denominator(mini: TensorBatch) -> float:
            (g_tokens,) = all_reduce_sum([mini.response_mask.sum().item()])
            return max(g_tokens, 1.0)

        def loss(micro: Micro) -> tuple[torch.Tensor, float]:
            sub, idx = micro.batch, micro.rows
            values = sequence_values(
                self.model, sub.input_ids, sub.attention_mask, sub.response_mask,
                micro_batch_size=len(sub),
            )  # fmt: skip
            value, clip = value_loss(
                values, old_values[idx], returns[idx], sub.response_mask, crit.value_clip
            )
            tokens = sub.response_mask.sum().item()
            if micro.epoch == 0 and micro.weight:
                sums["tokens"] += tokens
                sums["loss"] += float(value.detach()) * tokens
                sums["clip"] += float(clip) * tokens
            return value * crit.vf_coef, tokens

        norms = gradient_steps(
            self.model, self.critic_optimizer, self.critic_params, crit.grad_clip, batch,
            Objective(denominator, lambda mini, rows: self._critic_micro_batches(mini), loss),
            mini_batches=ucfg.mini_batches, epochs=ucfg.epochs,
        )  # fmt: skip
        self.critic_optimizer.zero_grad(set_to_none=True)
        tokens, total, clipped = all_reduce_sum([sums["tokens"], sums["loss"], sums["clip"]])
        return {
            "value_loss": total / max(tokens, 1.0),
            "value_clip_fraction": clipped / max(tokens, 1.0),
            "critic_grad_norm": norms[-1] if norms else 0.0,
        }
