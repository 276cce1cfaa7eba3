"""A job trains on verl's preprocessed parquet as is and exports a merged model (issue 14 #4, #5).

The whole local loop (2 gloo trainer ranks under torchrun, the test engine behind a real sync
sidecar) on the letter task written in verl's GSM8K schema: chat-list prompts, the answer at
reward_model.ground_truth, with the engine colocated in the trainer pod (`rollout.placement`).
`training.export: [adapter, merged]`: the merged folder, built from
the LoRA tensors gathered from both FSDP ranks, computes what base + adapter compute.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from harness.workloads.local_jobs import LETTERS, hf_engine, letter_job, read_history
from harness.workloads.verl_data import write_verl_gsm8k
from lorarl.local import LocalRun

pytestmark = pytest.mark.slow
STEPS = 3


def verl_letter_rows() -> list[dict]:
    rows = []
    for i, c in enumerate(LETTERS):
        nxt = chr(ord(c) + 1)
        rows.append(
            {
                "data_source": "letters",
                "prompt": [{"role": "user", "content": f"after {c}"}],
                "ability": "letters",
                "reward_model": {"style": "rule", "ground_truth": nxt},
                "extra_info": {"split": "train", "index": i, "answer": nxt, "question": c},
            }
        )
    return rows


def test_verl_parquet_trains_without_conversion_and_exports_merged(tmp_path: Path):
    data = write_verl_gsm8k(tmp_path / "train.parquet", verl_letter_rows())
    job = letter_job(
        tmp_path,
        name="verl-data",
        data={"trainFiles": [str(data)], "answerKey": "reward_model.ground_truth",
              "maxPromptTokens": 32, "maxResponseTokens": 4},
        reward={"function": "exact_match"},
        training={"totalSteps": STEPS, "promptsPerStep": 8, "microBatchSize": 16,
                  "checkpointInterval": STEPS, "export": ["adapter", "merged"]},
        rollout={"engine": "vllm", "replicas": 1, "gpusPerReplica": 0, "syncMode": "merged",
                 "placement": "colocated"},
    )  # fmt: skip
    engine = functools.partial(hf_engine, model=job.spec.model.path)
    with LocalRun(job, tmp_path / "run", engine_command=engine) as run:
        run.start()
        result = run.wait(timeout_s=600)
    assert result.progress is not None and result.progress.phase == "Succeeded", result
    assert [h["step"] for h in read_history(tmp_path / "run")] == list(range(1, STEPS + 1))
    # Colocated: the engine and its sidecar belong to the trainer pod (no rollout pod).
    assert sorted(c.name for c in run.children) == [
        "verl-data-trainer-0-engine", "verl-data-trainer-0-sidecar", "verl-data-trainer-0-trainer"
    ]  # fmt: skip

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, tmp_path / "run" / "adapter").eval()
    merged_dir = tmp_path / "run" / "merged"
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 20, 21, 22, 30, 31, 40]])
    with torch.no_grad():
        want, got = peft(ids).logits, merged(ids).logits
        untrained = peft.get_base_model()
        with peft.disable_adapter():
            base_logits = untrained(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert (want - base_logits).abs().max() > 1e-3  # the adapter trained: the check can fail
