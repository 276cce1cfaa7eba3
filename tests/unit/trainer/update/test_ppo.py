"""trainer/update/ppo.py in one process: the cross-rank statistics reduce to the verl-pinned ones,
and the
critic settings act on the update (vfCoef scales the critic's gradient, warm-up holds the actor)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from harness.workloads.tiny_models import make_tiny_model
from lorarl.trainer.model.critic import actor_parameters, add_critic, critic_parameters
from lorarl.trainer.model.loading import apply_lora, load_base_model, lora_state_dict
from lorarl.trainer.rl.advantages import explained_variance, whiten
from lorarl.trainer.rl.losses import LossConfig
from lorarl.trainer.update.actor import UpdateConfig
from lorarl.trainer.update.batch import collate
from lorarl.trainer.update.ppo import PPOConfig, PPOUpdate, global_explained_variance, global_whiten
from tests.integration import ppo_worker as W


def test_global_statistics_equal_the_single_batch_ones():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    torch.testing.assert_close(global_whiten(x, mask), whiten(x, mask), atol=1e-6, rtol=1e-5)
    ev = global_explained_variance(v, x, mask)
    assert ev == pytest.approx(float(explained_variance(v, x, mask)), abs=1e-6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("ppo") / "model", arch="llama")


def one_step(model_dir: Path, step: int, **critic) -> tuple[dict[str, float], dict, dict]:
    torch.manual_seed(0)
    model = apply_lora(load_base_model(model_dir), W.LORA)
    add_critic(model, W.CRITIC.lora)
    actor = [p for _, p in actor_parameters(model)]
    before = {k: t.clone() for k, t in lora_state_dict(model).items()}
    cfg = PPOConfig(1.0, 0.95, dataclasses.replace(W.CRITIC, grad_clip=1e6, **critic))
    ppo = PPOUpdate(
        model, torch.optim.AdamW(actor, lr=1e-2),
        torch.optim.AdamW([p for _, p in critic_parameters(model)], lr=1e-2),
        UpdateConfig(loss=LossConfig(), micro_batch_size=4), cfg, actor,
    )  # fmt: skip
    metrics = ppo.update(collate(W.batch_samples(1), 0), step)
    return metrics, before, lora_state_dict(model)


def test_vf_coef_scales_the_critic_gradient(model_dir: Path):
    m1, _, _ = one_step(model_dir, 2, vf_coef=1.0)
    m3, _, _ = one_step(model_dir, 2, vf_coef=3.0)
    assert m1["critic_grad_norm"] > 0
    assert m3["critic_grad_norm"] == pytest.approx(3 * m1["critic_grad_norm"], rel=1e-4)
    assert m3["value_loss"] == pytest.approx(m1["value_loss"], rel=1e-6)  # reported unscaled
    assert "kl_coef" not in m1  # no KL in the reward: no beta to report


def test_the_actor_holds_still_during_the_critic_warmup(model_dir: Path):
    metrics, before, after = one_step(model_dir, 1, warmup_steps=1)
    assert metrics["grad_norm"] == 0.0 and metrics["critic_grad_norm"] > 0
    assert all(torch.equal(before[k], after[k]) for k in before)
    metrics, before, after = one_step(model_dir, 2, warmup_steps=1)
    assert metrics["grad_norm"] > 0
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_the_local_console_shows_the_critic_for_ppo_runs():
    from rich.console import Console

    from lorarl.api.reports.progress import Progress, StepRecord
    from lorarl.local.console import LiveView

    view = LiveView(Console(record=True, width=120), "job", 4)
    record = StepRecord(step=1, time=0.0, reward_mean=0.5, value_loss=0.0123,
                        explained_variance=0.25)  # fmt: skip
    view.update(Progress(job="job", phase="Running", step=1, total_steps=4, latest=record))
    assert "value loss 0.0123 · ev 0.25" in view.progress.tasks[0].fields["metrics"]
    view.update(Progress(job="job", phase="Running", step=1, total_steps=4,
                         latest=StepRecord(step=1, time=0.0, reward_mean=0.5)))  # fmt: skip
    assert "value loss" not in view.progress.tasks[0].fields["metrics"]
