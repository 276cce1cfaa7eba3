"""The real pretrained model as `lorarl prepare smollm2` converts it. Training it is tested in
tests/e2e/test_trainer_rl_correctness.py (GRPO, 8 steps) and tests/e2e/test_ppo.py (PPO steps; the
saved adapter reproduces the trainer's logits exactly when loaded by PEFT)."""

from __future__ import annotations

import json

import pytest

from harness.workloads.pretrained import smollm2

pytestmark = pytest.mark.slow


def test_converted_model_is_plain_safetensors():
    config = json.loads((smollm2() / "config.json").read_text())
    assert "quantization_config" not in config  # vLLM refuses `quant_method: gguf`
    assert config["tie_word_embeddings"] is True  # SmolLM2's head shares the embedding
