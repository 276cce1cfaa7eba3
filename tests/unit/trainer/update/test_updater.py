"""trainer/update/updater.py: the job picks the updater; its learning rates and its part of the
checkpoint's trainer state are the ones the loop used to set and save itself."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lorarl.api.resource import LoRARLJob
from lorarl.trainer.rl.losses import LossConfig
from lorarl.trainer.update.actor import UpdateConfig
from lorarl.trainer.update.policy import Policy
from lorarl.trainer.update.ppo import ppo_config
from lorarl.trainer.update.state import lr_at
from lorarl.trainer.update.updater import ActorUpdater, PPOUpdater, build_updater


def job(algorithm: str, **spec: Any) -> LoRARLJob:
    return LoRARLJob.model_validate({
        "apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob", "metadata": {"name": "j"},
        "spec": {
            "model": {"path": "/models/m"},
            "data": {"trainFiles": ["t.jsonl"]},
            "algorithm": {"name": algorithm},
            "optim": {"lr": 1e-4, "warmupSteps": 2, "scheduler": "cosine"},
            "training": {"totalSteps": 10},
            **spec,
        },
    })  # fmt: skip


def sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


class FakePPO:
    """What PPOUpdater asks of `PPOUpdate` for the schedule and the checkpoint."""

    def __init__(self) -> None:
        self.actor_optimizer, self.critic_optimizer = sgd(), sgd()
        self.loaded: list[dict] = []

    def state_dict(self) -> dict:
        return {"kl_controller": {"value": 0.1}}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)


def policy(j: LoRARLJob, ppo: FakePPO | None = None) -> Any:
    optimizer = ppo.actor_optimizer if ppo else sgd()
    cfg = UpdateConfig(LossConfig(), micro_batch_size=1)
    # no model: building the updater never touches it
    return Policy(SimpleNamespace(), optimizer, cfg, None, ppo_config(j), None, ppo)


def test_a_critic_free_job_gets_the_actor_updater_and_its_schedule() -> None:
    j = job("grpo")
    updater = build_updater(j, policy(j))
    assert isinstance(updater, ActorUpdater) and updater.critic_optimizer is None
    for step in (1, 2, 5, 10):
        updater.set_lr(step)
        assert updater.lr == lr_at(step, 1e-4, 2, 10, "cosine")
    assert updater.state_dict() == {}


def test_ppo_sets_both_learning_rates_and_checkpoints_its_kl_controller() -> None:
    j = job("ppo", critic={"optim": {"lr": 3e-5, "warmupSteps": 4}})
    ppo = FakePPO()
    updater = build_updater(j, policy(j, ppo))
    assert isinstance(updater, PPOUpdater)
    assert updater.optimizer is ppo.actor_optimizer
    assert updater.critic_optimizer is ppo.critic_optimizer
    updater.set_lr(3)
    assert updater.lr == lr_at(3, 1e-4, 2, 10, "cosine")
    critic_lr = ppo.critic_optimizer.param_groups[0]["lr"]
    assert critic_lr == lr_at(3, 3e-5, 4, 10, "constant")
    assert updater.state_dict() == {"ppo": {"kl_controller": {"value": 0.1}}}
    updater.load_state_dict({"step": 3, "ppo": {"kl_controller": {"value": 0.2}}})
    updater.load_state_dict({"step": 3})  # a checkpoint from before the controller: defaults
    assert ppo.loaded == [{"kl_controller": {"value": 0.2}}, {}]


def test_the_updater_needs_the_step_count() -> None:
    j = job("grpo", training={"epochs": 1})
    with pytest.raises(ValueError, match="totalSteps"):
        build_updater(j, policy(j))
