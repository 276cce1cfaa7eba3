"""PPO's update on 2 FSDP2 ranks equals the same update in one process: advantages whitened and
explained variance measured over the whole batch, losses normalized by global token counts, the
KL controller fed the global KL, the critic warm-up skipped in step with every rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.workloads.tiny_models import make_tiny_model
from lorarl.local.ports import free_port
from tests.integration import ppo_worker as W

pytestmark = pytest.mark.slow  # one torchrun launch + one in-process run, ~20 s

REPO = Path(__file__).resolve().parents[2]


def test_two_ranks_equal_one_process(tmp_path: Path):
    model = make_tiny_model(tmp_path / "model", arch="llama")
    out = tmp_path / "ppo2.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(REPO / "tests/integration/ppo_worker.py"), "--model", str(model), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    two = torch.load(out, weights_only=False)
    one, history = W.run(model, env={})

    for part in ("actor", "critic"):
        assert one[part].keys() == two[part].keys()
        for name, t in one[part].items():
            torch.testing.assert_close(two[part][name], t, atol=2e-5, rtol=1e-4, msg=name)
    # The update moved both (else the comparison above would be trivial); the warm-up step did
    # not move the actor.
    assert all(h["critic_grad_norm"] > 0 for h in history)
    assert history[0]["grad_norm"] == 0.0 and history[1]["grad_norm"] > 0
    assert max(float(t.abs().max()) for n, t in one["actor"].items() if "lora_B" in n) > 0
    assert two["kl_coef"] == pytest.approx(one["kl_coef"], rel=1e-6)
    assert one["kl_coef"] != W.KL.coef  # the adaptive controller moved it
    for h1, h2 in zip(history, two["history"], strict=True):
        for key in ("value_loss", "explained_variance", "value_mean", "kl_in_reward", "grad_norm",
                    "critic_grad_norm", "value_clip_fraction"):  # fmt: skip
            assert h2[key] == pytest.approx(h1[key], rel=1e-4, abs=1e-6), key
