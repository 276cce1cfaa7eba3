"""Issue 13, "done when": GRPO on SmolLM2-135M-Instruct with temperature 0.7, LoRA dropout 0.05 and
two mini-batches per step, through the real local stack (vLLM on CPU started by the plan,
`--logprobs-mode processed_logprobs`, merged sync by the sidecar after every step).

- The first update of every step clips nothing: the policy has not moved, so the ratio is 1
  (before the fixes, dropout and the ignored temperature made it drift).
- The engine's logprobs equal the trainer's at the fp32 floor (same temperature-scaled
  distribution, same weights), so truncated importance sampling truncates nothing.
- It still learns: the reward rises.

Two variants: the learning run (`long`, make test-long: 8 steps of 4 prompts, the reward rises,
the merged export served by a fresh vLLM) and a 3-step run of 2 prompts per step in make test with
every other check (evals at 0, 2, 3; the merged export's bits are checked in
tests/integration/test_export_merged.py).

Issue 14, "done when", on the same run (no second SmolLM2 run): held-out prompts of the task
(data.valFiles) evaluated before training and every few steps (0, 5, 8), in the history, the
progress file, the REST API's job detail and the dashboard (headless Chromium); the evals in
TensorBoard's event files, a real `mlflow server`'s run and W&B's offline run file; and
`export: [adapter, merged]`, the merged folder served by a fresh vLLM (fp32) with the logprobs
of the PEFT model (base + the exported adapter) within fp32 noise.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.services.done_when import (
    check_dashboard_shows_eval,
    check_evals_served,
    check_merged_export_in_vllm,
    check_trackers,
)
from harness.services.mlflow_server import MlflowServer, mlflow_server_process
from harness.workloads.local_jobs import read_history
from harness.workloads.pretrained import smollm2
from lorarl.api import LoRARLJob
from lorarl.data_tasks import write_task_jsonl
from lorarl.local import LocalRun

pytestmark = pytest.mark.slow

VAL_PROMPTS = 16
LEARNS = 8  # steps of the long variant; the short one runs 3


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    with mlflow_server_process(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


def job(tmp_path: Path, mlflow_url: str, steps: int, eval_interval: int, prompts: int) -> LoRARLJob:
    """`prompts` per step (x8 samples): the mini-batch is half a step's samples, the
    micro-batch half a mini-batch, so every step has two mini-batches of two micro-batches."""
    data = write_task_jsonl(tmp_path / "larger.jsonl", "larger", n=64, seed=0)
    val = write_task_jsonl(tmp_path / "val.jsonl", "larger", n=VAL_PROMPTS, seed=1)
    train_prompts = {json.loads(line)["prompt"] for line in data.read_text().splitlines()}
    val_prompts = {json.loads(line)["prompt"] for line in val.read_text().splitlines()}
    assert len(val_prompts) == VAL_PROMPTS and not val_prompts & train_prompts  # held out
    return LoRARLJob.model_validate({
        "apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob", "metadata": {"name": "rlfix"},
        "spec": {
            "model": {"path": str(smollm2()), "dtype": "float32"},
            "lora": {"rank": 16, "alpha": 32, "dropout": 0.05},
            "algorithm": {"name": "grpo", "groupSize": 8},
            "optim": {"lr": 3e-4},
            "data": {"trainFiles": [str(data)], "valFiles": [str(val)], "maxPromptTokens": 128,
                     "maxResponseTokens": 24},
            "reward": {"function": "math_answer"},
            "training": {"totalSteps": steps, "promptsPerStep": prompts,
                         "miniBatchSize": prompts * 4, "microBatchSize": prompts * 2,
                         "checkpointInterval": steps,
                         "evalBeforeTrain": True, "evalInterval": eval_interval,
                         "export": ["adapter", "merged"]},
            "trainer": {"gpusPerReplica": 0, "processesPerReplica": 1},
            "rollout": {"engine": "vllm", "replicas": 1, "gpusPerReplica": 0,
                        "syncMode": "merged", "kvCacheGib": 1,
                        "sampling": {"temperature": 0.7}},
            "logging": {"backends": ["tensorboard", "mlflow", "wandb"],
                        "mlflow": {"trackingUri": mlflow_url, "experiment": "rlfix-e2e"},
                        "wandb": {"project": "rlfix-e2e", "mode": "offline"}},
        },
    })  # fmt: skip


@pytest.mark.parametrize(
    ("steps", "eval_steps", "prompts"),
    [
        # evalBeforeTrain, every evalInterval steps, and after the last step
        pytest.param(LEARNS, [0, 5, 8], 4, marks=pytest.mark.long, id="learns"),
        pytest.param(3, [0, 2, 3], 2, id="short"),
    ],
)
def test_grpo_at_temperature_with_dropout_and_mini_batches(
    tmp_path: Path,
    engine_python: str,
    mlflow_server: MlflowServer,
    monkeypatch: pytest.MonkeyPatch,
    steps: int,
    eval_steps: list[int],
    prompts: int,
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    the_job = job(tmp_path, mlflow_server.wait_healthy(), steps, eval_steps[1], prompts)
    with LocalRun(the_job, tmp_path / "run", engine_python=engine_python) as run:
        run.start()
        result = run.wait(timeout_s=900)
    assert result.progress is not None and result.progress.phase == "Succeeded", result
    history = read_history(tmp_path / "run")
    assert [h["step"] for h in history] == list(range(1, steps + 1))
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
    if steps == LEARNS:
        assert statistics.mean(rewards[-3:]) > statistics.mean(rewards[:3]) + 0.05, rewards

    run_dir = tmp_path / "run"
    check_evals_served(the_job, run_dir, eval_steps, VAL_PROMPTS)
    check_trackers(run_dir, mlflow_server.url, eval_steps)
    check_dashboard_shows_eval(the_job, run_dir)
    if steps == LEARNS:  # a second vLLM start (~50 s)
        check_merged_export_in_vllm(run_dir, smollm2(), tmp_path / "val.jsonl", engine_python)
