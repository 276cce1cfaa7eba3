"""A finished step's numbers -> the `StepRecord` rank 0 reports (progress, history, trackers)."""

from __future__ import annotations

import time
from typing import Any

from lorarl.api.reports.progress import StepRecord
from lorarl.api.reports.status import SyncStatus
from lorarl.trainer.generation.rollouts import Collected
from lorarl.trainer.rl.samples import TrainSample

# Update metrics copied into the record under the same name when the step produced them
# (PPO's critic and KL-in-reward numbers; absent for the other algorithms).
_OPTIONAL = (
    "value_loss",
    "value_clip_fraction",
    "explained_variance",
    "value_mean",
    "critic_grad_norm",
    "kl_coef",
    "kl_in_reward",
)


def step_record(
    step: int,
    collected: Collected,
    metrics: dict[str, float],
    *,
    train_s: float,
    sync: SyncStatus | None,
    t_start: float,
    lr: float,
    cpu_util: float | None = None,
) -> StepRecord:
    rewards = collected.rewards
    samples: list[TrainSample] = collected.samples
    step_s = time.perf_counter() - t_start
    # the model's tokens only: an episode's environment tokens are context, not response
    lengths = [sum(s.loss_mask) if s.loss_mask else len(s.completion_ids) for s in samples]
    tokens = collected.generated_tokens + metrics["trained_tokens"]
    # Fields present for some algorithms or agent runs only; StepRecord validates each value.
    extra: dict[str, Any] = {k: metrics[k] for k in _OPTIONAL if k in metrics}
    extra.update(collected.episode_stats or {})
    return StepRecord(
        step=step,
        time=time.time(),
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()) if rewards.numel() > 1 else 0.0,
        # With the KL in the reward (PPO's kl.inReward) the loss has no KL term: report that one.
        kl=metrics.get("kl", metrics.get("kl_in_reward")),
        entropy=metrics.get("entropy"),
        loss=metrics.get("loss"),
        clip_fraction=metrics.get("clip_frac"),
        clip_fraction_first_update=metrics["clip_frac_first_update"],
        grad_norm=metrics["grad_norm"],
        lr=lr,
        tokens_per_second=tokens / step_s,
        response_length_mean=sum(lengths) / max(len(lengths), 1),
        logprob_mismatch=metrics["logprob_mismatch"],
        logprob_mismatch_p50=metrics["logprob_mismatch_p50"],
        logprob_mismatch_p90=metrics["logprob_mismatch_p90"],
        logprob_mismatch_p99=metrics["logprob_mismatch_p99"],
        tis_clip_frac=metrics.get("tis_clip_frac"),
        truncated_fraction=collected.truncated_fraction,
        weight_version=min(s.weight_version for s in samples),
        step_seconds=step_s,
        cpu_util=cpu_util,
        generate_seconds=collected.generate_seconds,
        reward_seconds=collected.reward_seconds,
        train_seconds=train_s,
        sync_seconds=sync.seconds if sync else None,
        sync_bytes=sync.bytes if sync else None,
        sync_members=sync.members if sync else None,
        engine_requests=collected.engine_requests,
        engine_rewards=collected.engine_rewards,
        skipped_prompts=collected.skipped_prompts if collected.episode_stats is not None else None,
        reward_metrics=collected.reward_metrics,
        **extra,
    )
