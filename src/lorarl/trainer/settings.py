"""The trainer's inputs: the rendered job (what to train) and the plan's env (where things are)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from lorarl.api.resource import LoRARLJob
from lorarl.api.validation import ManifestError, load_job_file
from lorarl.plan.engines import ENGINE_API_KEY_ENV
from lorarl.rewards.service.client import RewardServiceClient
from lorarl.trainer.errors import ConfigError

log = logging.getLogger(__name__)


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
