"""The algorithm's update behind one interface, so the training step never asks which algorithm
it runs: `ActorUpdater` for the critic-free algorithms (GRPO, RLOO, REINFORCE++, ...),
`PPOUpdater` for PPO (critic first, then the actor). `build_updater` picks one from the job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from peft import PeftModel

from lorarl.api.resource import LoRARLJob
from lorarl.sync.adapter_files import adapter_fingerprint
from lorarl.trainer.model.critic import critic_state_dict
from lorarl.trainer.update.actor import UpdateConfig, update_policy
from lorarl.trainer.update.batch import TensorBatch
from lorarl.trainer.update.policy import Policy
from lorarl.trainer.update.ppo import PPOUpdate
from lorarl.trainer.update.state import lr_at

# The checkpoint's trainer-state key of PPO's own state (the KL controller).
PPO_STATE = "ppo"


@dataclass(frozen=True)
class LRSchedule:
    """One optimizer's learning rate by step (`lr_at`): a pure function of the step, so a
    resumed run needs no scheduler state."""

    lr: float
    warmup_steps: int
    total_steps: int
    scheduler: str

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, self.lr, self.warmup_steps, self.total_steps, self.scheduler)


class Updater(Protocol):
    """One step's update on this rank's share of the samples (collective on every rank)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The actor's optimizer (checkpointed as optimizer.pt)."""

    @property
    def critic_optimizer(self) -> torch.optim.Optimizer | None:
        """The critic's optimizer; None without a critic."""

    @property
    def lr(self) -> float:
        """The actor's learning rate this step (the step record's)."""

    def set_lr(self, step: int) -> None:
        """Every optimizer's learning rate for 1-based `step`."""

    def update(self, batch: TensorBatch, step: int, *, replicas: int) -> dict[str, float]:
        """Train on `batch`; the step's metrics. `replicas`: the step's engine count."""

    def state_dict(self) -> dict[str, Any]:
        """What the update adds to the checkpoint's trainer state."""

    def load_state_dict(self, trainer_state: Mapping[str, Any]) -> None:
        """Take back `state_dict`'s part of a checkpoint's trainer state."""

    def fingerprint(self) -> str:
        """What the resume log adds to the adapter's fingerprint (collective)."""


@dataclass
class ActorUpdater:
    """The critic-free algorithms: the policy-gradient step on the actor alone."""

    model: PeftModel
    optimizer: torch.optim.Optimizer
    cfg: UpdateConfig
    reference: dict[str, torch.Tensor] | None  # the KL reference; None: the base model
    schedule: LRSchedule
    critic_optimizer: None = None

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, step: int) -> None:
        self.schedule.apply(self.optimizer, step)

    def update(self, batch: TensorBatch, step: int, *, replicas: int) -> dict[str, float]:
        return update_policy(
            self.model, self.optimizer, batch, self.cfg, reference=self.reference,
            replicas=replicas,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, trainer_state: Mapping[str, Any]) -> None:
        pass

    def fingerprint(self) -> str:
        return ""


@dataclass
class PPOUpdater:
    """PPO: values, GAE, the critic's step, then the actor's (`ppo.PPOUpdate`); the KL
    controller's state rides in every checkpoint."""

    model: PeftModel
    ppo: PPOUpdate
    reference: dict[str, torch.Tensor] | None
    schedule: LRSchedule
    critic_schedule: LRSchedule

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.ppo.actor_optimizer

    @property
    def critic_optimizer(self) -> torch.optim.Optimizer:
        return self.ppo.critic_optimizer

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, step: int) -> None:
        self.schedule.apply(self.optimizer, step)
        self.critic_schedule.apply(self.critic_optimizer, step)

    def update(self, batch: TensorBatch, step: int, *, replicas: int) -> dict[str, float]:
        return self.ppo.update(batch, step, reference=self.reference, replicas=replicas)

    def state_dict(self) -> dict[str, Any]:
        return {PPO_STATE: self.ppo.state_dict()}

    def load_state_dict(self, trainer_state: Mapping[str, Any]) -> None:
        self.ppo.load_state_dict(trainer_state.get(PPO_STATE, {}))

    def fingerprint(self) -> str:
        """What the exact-resume check compares with the checkpoint besides the actor."""
        critic = adapter_fingerprint(critic_state_dict(self.model))  # collective
        return f", critic {critic}, kl coef {self.ppo.kl_coef!r}"


def build_updater(job: LoRARLJob, policy: Policy) -> Updater:
    """The job's updater over `policy`'s model and optimizers; `training.totalSteps` must be
    resolved already (the learning-rate schedules end there)."""
    spec = job.spec
    total = spec.training.total_steps
    if total is None:
        raise ValueError("training.totalSteps is resolved before the updater is built")
    o = spec.optim
    actor = LRSchedule(o.lr, o.warmup_steps, total, o.scheduler)
    if policy.ppo is None or policy.ppo_cfg is None:
        return ActorUpdater(
            policy.model, policy.optimizer, policy.update_cfg, policy.kl_reference, actor
        )
    c = policy.ppo_cfg.critic
    critic = LRSchedule(c.lr, c.warmup_steps_lr, total, c.scheduler)
    return PPOUpdater(policy.model, policy.ppo, policy.kl_reference, actor, critic)
