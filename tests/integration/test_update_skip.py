"""Skipping samples with no advantage under FSDP2 on two real gloo ranks (torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness.workloads.tiny_models import make_tiny_model
from lorarl.local.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def test_ranks_with_different_numbers_of_samples_to_train_meet_and_agree(tmp_path):
    model = make_tiny_model(tmp_path / "model", arch="llama")
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(REPO / "tests/integration/skip_worker.py"), str(model), str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["tensors"] > 0 and result["moved"] > 0
    # the same step as the update that ran every sample, up to the order of float sums
    assert result["max_gap"] < 1e-4 * result["moved"]
