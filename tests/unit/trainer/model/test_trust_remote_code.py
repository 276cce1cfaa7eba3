"""model.trustRemoteCode reaches the trainer's loads (issue 14): a model folder whose class lives
in its own Python files loads only with it, and its merged export keeps that code.

transformers copies the folder's code into HF_MODULES_CACHE and imports it from there; the test
points that at tmp_path (and restores sys.path), so nothing lands in the user's cache.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import transformers.dynamic_module_utils as dynamic_modules

from harness.workloads.tiny_models import make_tiny_model
from lorarl.trainer.checkpoint.export import merge_lora
from lorarl.trainer.model.loading import (
    LoraSettings,
    ModelLoadError,
    apply_lora,
    load_base_model,
    lora_state_dict,
)

CONFIG_PY = """
from transformers import LlamaConfig


class CustomConfig(LlamaConfig):
    model_type = "lorarl_custom"
"""
MODELING_PY = """
from transformers import LlamaForCausalLM

from .configuration_custom import CustomConfig


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""


def custom_code_model(root: Path) -> Path:
    path = make_tiny_model(root / "custom", arch="llama")
    (path / "configuration_custom.py").write_text(CONFIG_PY)
    (path / "modeling_custom.py").write_text(MODELING_PY)
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="lorarl_custom",
        architectures=["CustomForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
        },
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_custom_code_model_loads_only_when_trusted_and_its_merge_keeps_the_code(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(dynamic_modules, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = custom_code_model(tmp_path)
    with pytest.raises(ModelLoadError, match="trust_remote_code"):
        load_base_model(path)  # without the flag: a clear refusal, no code run
    model = load_base_model(path, trust_remote_code=True)
    assert type(model).__name__ == "CustomForCausalLM"
    peft = apply_lora(model, LoraSettings(rank=4, alpha=8))
    merged = merge_lora(
        path, peft.peft_config["default"], lora_state_dict(peft), trust_remote_code=True
    )
    assert type(merged).__name__ == "CustomForCausalLM"
    merged.save_pretrained(tmp_path / "merged")
    assert (tmp_path / "merged" / "modeling_custom.py").is_file()
    assert (tmp_path / "modules").is_dir()  # the test's cache, not the user's
