"""A trainer killed with SIGKILL mid-run resumes from its newest complete checkpoint: same step
count, same data position, adapter bit-identical to the checkpoint's; a truncated checkpoint is
skipped with a warning."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from harness.workloads.local_jobs import hf_engine, letter_job, read_history
from lorarl.local import LocalRun
from lorarl.sync.adapter_files import adapter_fingerprint

pytestmark = pytest.mark.slow

TRAINING = {"totalSteps": 8, "promptsPerStep": 4, "microBatchSize": 16, "checkpointInterval": 3}


def test_sigkill_then_resume(tmp_path: Path):
    job = letter_job(tmp_path, training=TRAINING, rollout={
        "engine": "vllm", "replicas": 1, "gpusPerReplica": 0, "syncMode": "merged"})  # fmt: skip
    engine = functools.partial(hf_engine, model=job.spec.model.path)
    run_dir = tmp_path / "run"

    with LocalRun(job, run_dir, engine_command=engine) as run:
        run.start()
        deadline = time.monotonic() + 300
        while (p := run.progress()) is None or p.step < 4:
            assert run.trainer.poll() is None, run.trainer.tail()
            assert time.monotonic() < deadline, "trainer made no progress"
            time.sleep(0.2)
        os.killpg(run.trainer.pid, signal.SIGKILL)  # torchrun and both ranks, no cleanup
        run.trainer.proc.wait(timeout=30)

    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "step-000003" / "COMPLETE").is_file()
    # A checkpoint cut off mid-write (no COMPLETE marker) must be ignored.
    truncated = checkpoints / "step-000006"
    (truncated / "adapter").mkdir(parents=True, exist_ok=True)
    (truncated / "adapter" / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    saved = json.loads((checkpoints / "step-000003" / "state.json").read_text())["trainer_state"]
    saved_adapter = load_file(checkpoints / "step-000003" / "adapter" / "adapter_model.safetensors")

    with LocalRun(job, run_dir, engine_command=engine) as run:
        run.start()
        result = run.wait(timeout_s=300)

    log = (run_dir / "logs" / "learn-trainer-0-trainer.log").read_text()
    resumed = re.search(r"resumed from \S+step-000003 at step 3 \(data position (\{.*?\}), "
                        r"adapter (\w+)\)", log)  # fmt: skip
    assert resumed, log[-3000:]
    assert json.loads(resumed.group(1).replace("'", '"')) == saved["position"]
    assert resumed.group(2) == adapter_fingerprint(saved_adapter)
    assert "step-000006" in log and "skip" in log.lower()
    assert result.progress.phase == "Succeeded" and result.progress.step == 8
    assert [h["step"] for h in read_history(run_dir)] == list(range(1, 9))
    # 8 steps x 4 prompts over 8 prompts: 4 epochs, wherever the run was interrupted.
    final = json.loads((checkpoints / "step-000008" / "state.json").read_text())["trainer_state"]
    assert final["position"] == {"epoch": 4, "index": 0}
