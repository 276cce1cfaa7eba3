"""Issue 13, "done when": GRPO on SmolLM2-135M-Instruct with temperature 0.7, LoRA dropout 0.05 and
two mini-batches per step, through the real local stack (vLLM on CPU started by the plan,
`--logprobs-mode processed_logprobs`, merged sync by the sidecar after every step).

- The first update of every step clips nothing: the policy has not moved, so the ratio is 1
  (before the fixes, dropout and the ignored temperature made it drift).
- The engine's logprobs equal the trainer's at the fp32 floor (same temperature-scaled
  distribution, same weights), so truncated importance sampling truncates nothing.
- It still learns: the reward rises.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from lorarl.api import LoRARLJob
from lorarl.data_tasks import write_task_jsonl
from lorarl.local import LocalRun
from tests.support.local_jobs import read_history
from tests.support.models import smollm2

pytestmark = pytest.mark.slow

STEPS = 8


def job(tmp_path: Path) -> LoRARLJob:
    data = write_task_jsonl(tmp_path / "larger.jsonl", "larger", n=64, seed=0)
    return LoRARLJob.model_validate({
        "apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob", "metadata": {"name": "rlfix"},
        "spec": {
            "model": {"path": str(smollm2()), "dtype": "float32"},
            "lora": {"rank": 16, "alpha": 32, "dropout": 0.05},
            "algorithm": {"name": "grpo", "groupSize": 8},
            "optim": {"lr": 3e-4},
            "data": {"trainFiles": [str(data)], "maxPromptTokens": 128, "maxResponseTokens": 24},
            "reward": {"function": "math_answer"},
            "training": {"totalSteps": STEPS, "promptsPerStep": 4, "miniBatchSize": 16,
                         "microBatchSize": 8, "checkpointInterval": STEPS},
            "trainer": {"gpusPerReplica": 0, "processesPerReplica": 1},
            "rollout": {"engine": "vllm", "replicas": 1, "gpusPerReplica": 0,
                        "syncMode": "merged", "kvCacheGib": 1,
                        "sampling": {"temperature": 0.7}},
        },
    })  # fmt: skip


def test_grpo_at_temperature_with_dropout_and_mini_batches(tmp_path: Path, engine_python: str):
    with LocalRun(job(tmp_path), tmp_path / "run", engine_python=engine_python) as run:
        run.start()
        result = run.wait(timeout_s=900)
    assert result.progress is not None and result.progress.phase == "Succeeded", result
    history = read_history(tmp_path / "run")
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    for h in history:
        print(
            f"step {h['step']}: reward {h['rewardMean']:.3f} clip(first) "
            f"{h['clipFractionFirstUpdate']:.4f} clip {h['clipFraction']:.4f} mismatch "
            f"{h['logprobMismatch']:.2e} p99 {h['logprobMismatchP99']:.1e} tis "
            f"{h['tisClipFrac']:.4f}"
        )
    assert max(h["clipFractionFirstUpdate"] for h in history) < 1e-3
    assert max(h["logprobMismatch"] for h in history) < 1e-4  # vLLM fp32 vs HF fp32: ~5e-6
    assert max(h["logprobMismatchP99"] for h in history) <= 1e-3
    assert max(h["tisClipFrac"] for h in history) == 0.0
    rewards = [h["rewardMean"] for h in history]
    assert statistics.mean(rewards[-3:]) > statistics.mean(rewards[:3]) + 0.05, rewards
