"""The real pretrained model: two GRPO steps with LoRA r=8 on SmolLM2-135M-Instruct, and the saved
adapter reproduces the trainer's logits exactly when loaded by PEFT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lorarl.api import LoRARLJob
from lorarl.data_tasks import write_task_jsonl
from lorarl.trainer.loop import Trainer
from lorarl.trainer.parallel import init_distributed
from lorarl.trainer.settings import Endpoints
from tests.support.hf_engine_server import create_app, serve_in_thread
from tests.support.models import smollm2

pytestmark = pytest.mark.slow


def test_converted_model_is_plain_safetensors():
    config = json.loads((smollm2() / "config.json").read_text())
    assert "quantization_config" not in config  # vLLM refuses `quant_method: gguf`
    assert config["tie_word_embeddings"] is True  # SmolLM2's head shares the embedding


def test_two_grpo_steps_and_a_faithful_adapter(tmp_path: Path):
    model_dir = smollm2()
    data = write_task_jsonl(tmp_path / "addition.jsonl", "addition", n=16, seed=0)
    job = LoRARLJob.model_validate({
        "apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob", "metadata": {"name": "smol"},
        "spec": {
            "model": {"path": str(model_dir), "dtype": "float32"},
            "lora": {"rank": 8, "alpha": 16},
            "algorithm": {"name": "grpo", "groupSize": 4, "entropyCoef": 0.01},
            "optim": {"lr": 1e-4},
            "data": {"trainFiles": [str(data)], "maxPromptTokens": 128, "maxResponseTokens": 24},
            "reward": {"function": "math_answer"},
            "training": {"totalSteps": 2, "promptsPerStep": 4, "microBatchSize": 8,
                         "checkpointInterval": 2, "outputDir": str(tmp_path / "out")},
            "trainer": {"gpusPerReplica": 0},
            "rollout": {"engine": "vllm", "replicas": 1, "gpusPerReplica": 0},
        },
    })  # fmt: skip
    url, stop = serve_in_thread(create_app(model_dir, served_model_name="base"))
    try:
        trainer = Trainer(job, Endpoints(rollout=[url]), init_distributed(env={}))
        trainer.run()
    finally:
        stop()
    history = trainer.tracker.history
    assert [r.step for r in history] == [1, 2]
    assert all(r.response_length_mean > 0 for r in history)

    trained = trainer.model.eval()
    b_norm = sum(float(p.detach().norm()) for n, p in trained.named_parameters() if "lora_B" in n)
    assert b_norm > 0, "the adapter did not change: the comparison below would be trivial"
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        tmp_path / "out" / "adapter",
    ).eval()
    ids = trainer.tokenizer("What is 12 + 30? Answer with just the number.", return_tensors="pt")
    with torch.no_grad():
        expected = trained(**ids).logits
        got = loaded(**ids).logits
    assert (got - expected).abs().max().item() <= 1e-5
