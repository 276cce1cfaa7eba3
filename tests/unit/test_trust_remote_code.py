"""model.trustRemoteCode reaches the trainer's loads (issue 14): a model folder whose class lives
in its own Python files loads only with it, and its merged export keeps that code.

Runs in a child interpreter with HF_MODULES_CACHE under tmp_path, so transformers' copies of the
folder's code never land in the user's cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow  # a child interpreter importing torch: ~12 s of CPU

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
CHILD = """
import sys
from pathlib import Path

from lorarl.trainer.export import merge_lora
from lorarl.trainer.model import (
    LoraSettings, ModelLoadError, apply_lora, load_base_model, lora_state_dict,
)

path = Path(sys.argv[1])
try:
    load_base_model(path)
except ModelLoadError as exc:
    print("refused:", "trust_remote_code" in str(exc))
model = load_base_model(path, trust_remote_code=True)
print("class:", type(model).__name__)
peft = apply_lora(model, LoraSettings(rank=4, alpha=8))
tensors = lora_state_dict(peft)
merged = merge_lora(path, peft.peft_config["default"], tensors, trust_remote_code=True)
merged.save_pretrained(path.parent / "merged")
print("merged:", type(merged).__name__)
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


def test_custom_code_model_loads_only_when_trusted_and_its_merge_keeps_the_code(tmp_path):
    path = custom_code_model(tmp_path)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert "refused: True" in lines  # without the flag: a clear refusal, no code run
    assert "class: CustomForCausalLM" in lines and "merged: CustomForCausalLM" in lines
    assert (tmp_path / "merged" / "modeling_custom.py").is_file()
    assert (tmp_path / "modules").is_dir()  # the child's cache, not the user's
