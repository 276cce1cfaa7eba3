"""The trainer's inputs: the rendered job (what to train) and the plan's env (where things are)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from lorarl.api.resource import LoRARLJob
from lorarl.api.spec.critic import CriticSpec
from lorarl.api.validation import ManifestError, load_job_file
from lorarl.plan.engines import ENGINE_API_KEY_ENV
from lorarl.rewards.service.client import RewardServiceClient
from lorarl.trainer.model.loading import LoraSettings
from lorarl.trainer.rl.losses import LossConfig

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A job the trainer cannot run; the message is the one line the user sees."""


@dataclass(frozen=True)
class Endpoints:
    rollout: list[str]
    sidecars: list[str] = field(default_factory=list)
    sync_addr: str | None = None
    sync_port: int | None = None
    sync_world_size: int = 1
    sync_backend: str | None = None  # the plan's choice (the sidecars use the same)
    reward: str | None = None
    progress_port: int | None = None
    engine_api_key: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Endpoints:
        env = dict(os.environ) if env is None else env

        def split(name: str) -> list[str]:
            return [u for u in env.get(name, "").split(",") if u]

        port = env.get("LORARL_SYNC_PORT")
        progress = env.get("LORARL_PROGRESS_PORT")
        return cls(
            rollout=split("LORARL_ROLLOUT_ENDPOINTS"),
            sidecars=split("LORARL_SIDECAR_ENDPOINTS"),
            sync_addr=env.get("LORARL_SYNC_ADDR"),
            sync_port=int(port) if port else None,
            sync_world_size=int(env.get("LORARL_SYNC_WORLD_SIZE", "1")),
            sync_backend=env.get("LORARL_SYNC_BACKEND") or None,
            reward=env.get("LORARL_REWARD_ENDPOINT"),
            progress_port=int(progress) if progress else None,
            engine_api_key=env.get(ENGINE_API_KEY_ENV) or None,
        )


def load_job(path: str | Path) -> LoRARLJob:
    try:
        return load_job_file(path)
    except ManifestError as exc:
        raise ConfigError(f"job config {path}: {exc}") from exc


def lora_settings(job: LoRARLJob) -> LoraSettings:
    lora = job.spec.lora
    targets = lora.target_modules
    return LoraSettings(
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        exclude_modules=list(lora.exclude_modules),
        use_rslora=lora.use_rslora,
        adapter_path=lora.adapter_path,
    )


@dataclass(frozen=True)
class AlgorithmChoices:
    """The algorithm's name-dependent defaults, resolved (the CRD leaves these fields unset so
    that the name can decide; its descriptions state the defaults)."""

    clip_high: float
    agg: str
    norm_len: int | None
    dynamic_sampling: bool
    dynamic_metric: str  # "reward" (before the overlong punishment) or "shaped-reward"
    overlong_mask: bool
    soft_punishment: bool
    buffer_tokens: int
    penalty_factor: float


def algorithm_choices(job: LoRARLJob) -> AlgorithmChoices:
    a, max_response = job.spec.algorithm, job.spec.data.max_response_tokens
    dapo = a.name == "dapo"
    agg = a.loss_aggregation or ("seq-mean-token-sum-norm" if a.name == "dr_grpo" else "token-mean")
    norm = a.loss_norm_length
    if agg == "seq-mean-token-sum-norm" and norm is None:
        norm = max_response
    o = a.overlong
    return AlgorithmChoices(
        clip_high=a.clip_ratio_high if a.clip_ratio_high is not None else (0.28 if dapo else 0.2),
        agg=agg,
        norm_len=norm,
        dynamic_sampling=(
            a.dynamic_sampling.enabled if a.dynamic_sampling.enabled is not None else dapo
        ),
        dynamic_metric=a.dynamic_sampling.metric,
        overlong_mask=bool(o.mask),
        soft_punishment=o.soft_punishment if o.soft_punishment is not None else dapo,
        buffer_tokens=o.buffer_tokens or max(1, max_response // 5),
        penalty_factor=o.penalty_factor,
    )


def loss_config(job: LoRARLJob) -> LossConfig:
    """The spec's algorithm section as the loss sees it, name-dependent defaults resolved. With
    kl.inReward the KL is a reward penalty (`kl_reward_settings`), not a loss term: kl_coef 0."""
    a, c = job.spec.algorithm, algorithm_choices(job)
    in_reward = a.kl.in_reward
    if a.kl.coef > 0 and a.kl.estimator == "k1" and not in_reward:
        log.warning(
            "spec.algorithm.kl.estimator k1 as a loss has zero gradient in expectation: the KL "
            "term will not pull the policy toward the reference; use k2/mse (the gradient of "
            "KL(pi || ref)) or k3/low_var_kl"
        )
    return LossConfig(
        clip_low=a.clip_ratio_low,
        clip_high=c.clip_high,
        dual_clip=a.dual_clip,
        agg=c.agg,
        norm_len=c.norm_len,
        kl_coef=0.0 if in_reward else a.kl.coef,
        kl_estimator=a.kl.estimator,
        entropy_coef=a.entropy_coef,
        correction=a.rollout_correction.mode,
        correction_threshold=a.rollout_correction.threshold,
    )


def advantage_estimator(job: LoRARLJob) -> str:
    """The spec's algorithm name -> the advantage estimator in `advantages.py` ("ppo": per-token
    advantages come later, from GAE over the critic's values)."""
    algo = job.spec.algorithm
    if algo.name == "reinforce_pp":
        return "reinforce_pp_baseline" if algo.group_size > 1 else "reinforce_pp"
    return algo.name


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
    actor, own = job.spec.lora, critic.lora
    targets = own.target_modules if own.target_modules is not None else actor.target_modules
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
class KLRewardSettings:
    """The KL penalty in the token rewards (algorithm.kl.inReward): coef is the initial beta."""

    coef: float
    estimator: str
    controller: str  # fixed | adaptive
    target_kl: float
    horizon: int


def kl_reward_settings(job: LoRARLJob) -> KLRewardSettings | None:
    """None unless algorithm.kl.inReward (then the loss has no KL term: see `loss_config`)."""
    kl = job.spec.algorithm.kl
    if not kl.in_reward:
        return None
    return KLRewardSettings(
        coef=kl.coef,
        estimator=kl.estimator,
        controller=kl.controller,
        target_kl=kl.target_kl,
        horizon=kl.horizon,
    )


def reward_service_client(job: LoRARLJob, endpoint: str | None) -> RewardServiceClient | None:
    """The client of the job's reward service (None: the trainer scores in-process). Requests
    name the spec's reward (function or entrypoint): the service lorarl runs serves it under
    that name, and an external one (service.url) may serve several."""
    reward = job.spec.reward
    if reward.service is None:
        return None
    url = endpoint or reward.service.url
    if not url:
        raise ConfigError(
            "spec.reward.service is set but no url is known "
            "(LORARL_REWARD_ENDPOINT is empty and spec.reward.service.url is unset)"
        )
    name = reward.function or reward.entrypoint
    return RewardServiceClient.from_spec(url, reward.service, reward=name)


def output_dirs(job: LoRARLJob) -> tuple[Path, Path, Path]:
    """(output root, checkpoints, final adapter)."""
    root = Path(job.spec.training.output_dir)
    return root, root / "checkpoints", root / "adapter"
