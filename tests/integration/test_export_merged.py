"""`training.export: [adapter, merged]` (issue 14 #5): the merged folder is a plain Hugging Face
model that transformers loads, computing what the PEFT model computes.

The PEFT model is the trainer's own (`apply_lora` on the tiny Llama, `all-linear`, fp32) with
every LoRA tensor perturbed, so the merged model is far from the base (checked: a merge that did
nothing fails). That vLLM serves a real run's merged folder with PEFT's logprobs is checked end
to end on SmolLM2 in tests/e2e/test_trainer_rl_correctness.py (no vLLM start here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness.workloads.tiny_models import make_tiny_model
from lorarl.api.resource import LoRARLJob
from lorarl.trainer.checkpoint.export import export_final, merge_lora
from lorarl.trainer.model.loading import LoraSettings, apply_lora, load_base_model, lora_parameters

RANK, ALPHA = 8, 12.0
PROMPT = [20, 21, 22, 30, 31, 40, 50, 60, 70, 33]


def peft_model(base_dir: Path):
    model = apply_lora(load_base_model(base_dir), LoraSettings(rank=RANK, alpha=ALPHA))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def job_for(base_dir: Path, out: Path) -> LoRARLJob:
    return LoRARLJob.model_validate(
        {
            "apiVersion": "lorarl.dev/v1alpha1",
            "kind": "LoRARLJob",
            "metadata": {"name": "export"},
            "spec": {
                "model": {"path": str(base_dir), "dtype": "float32"},
                "lora": {"rank": RANK, "alpha": ALPHA},
                "data": {"trainFiles": ["unused.jsonl"]},
                "training": {"outputDir": str(out), "export": ["adapter", "merged"]},
            },
        }
    )


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("export")
    base_dir = make_tiny_model(root / "base", arch="llama", init_std=0.1)
    model = peft_model(base_dir)
    out = root / "out"
    job = job_for(base_dir, out)
    export_final(model, job, AutoTokenizer.from_pretrained(base_dir), out / "adapter")
    return {"root": root, "base": base_dir, "peft": model, "merged": out / "merged", "out": out}


def test_merged_folder_is_a_plain_hf_model_equal_to_peft(exported):
    out, merged_dir = exported["out"], exported["merged"]
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "merged"]  # no temp dirs left
    with safe_open(str(merged_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and not [n for n in names if "lora" in n or "base_layer" in n]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(exported["base"], dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = exported["peft"](ids).logits
        got = merged(ids).logits
        far = base(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert (far - want).abs().max() > 0.1  # the adapter changed the model; the merge kept it
    tok = AutoTokenizer.from_pretrained(merged_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert json.loads((merged_dir / "config.json").read_text())["architectures"]


def test_merge_casts_once_to_the_serving_dtype(exported):
    tensors = {
        k.replace(".default.", "."): p.detach().clone()
        for k, p in lora_parameters(exported["peft"])
    }
    config = exported["peft"].peft_config["default"]
    bf16 = merge_lora(exported["base"], config, tensors, "bfloat16")
    fp32 = merge_lora(exported["base"], config, tensors, "float32")
    w16 = bf16.get_parameter("model.layers.0.self_attn.q_proj.weight")
    w32 = fp32.get_parameter("model.layers.0.self_attn.q_proj.weight")
    assert w16.dtype == torch.bfloat16
    assert torch.equal(w16, w32.to(torch.bfloat16))  # merged in fp32, rounded once
