"""`training.export: [adapter, merged]` (issue 14 #5): the merged folder is a plain Hugging Face
model that transformers and vLLM load, computing what the PEFT model computes.

The PEFT model is the trainer's own (`apply_lora` on the tiny Llama, `all-linear`, fp32) with
every LoRA tensor perturbed, so the merged model is far from the base (checked: a merge that did
nothing fails). vLLM runs on CPU under the engine interpreter in fp32, as in the sync tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorarl.api.job import LoRARLJob
from lorarl.local.ports import free_port
from lorarl.rollout.vllm_engine import vllm_launch_command
from lorarl.trainer.export import export_final, merge_lora
from lorarl.trainer.model import LoraSettings, apply_lora, load_base_model, lora_parameters
from tests.support.tiny_models import make_tiny_model

RANK, ALPHA = 8, 12.0
PROMPT = [20, 21, 22, 30, 31, 40, 50, 60, 70, 33]
NEW_TOKENS = 8
API_KEY = "engine-key-for-tests"
# fp32 on both sides, different kernels: fp32 noise (the sync tests allow 1e-3).
MAX_MEAN_GAP = 1e-4  # measured 1.1e-6
MIN_BASE_GAP = 1e-2  # the base model is this far away, so the bound can tell them apart


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


def logprobs_of(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    """Logprob of each token after PROMPT, fp32 (as vLLM reports for its own samples)."""
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [logp[len(PROMPT) + i - 1, t].item() for i, t in enumerate(tokens)]


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


# ---------------------------------------------------------------- vLLM serves the merged folder


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):  # the engine core may outlive the server
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_vllm_serves_the_merged_folder_with_pefts_logprobs(exported, engine_python: str):
    root, merged_dir = exported["root"], exported["merged"]
    port = free_port()
    argv, env = vllm_launch_command(
        merged_dir, port, served_model_name="merged", run_dir=root / "run", dtype="float32",
        kv_cache_gib=1, max_model_len=128, python=engine_python, api_key=API_KEY,
        worker_extension_cls=None,
    )  # fmt: skip
    Path(env["TMPDIR"]).mkdir(parents=True)
    url = f"http://127.0.0.1:{port}"
    with open(root / "vllm.log", "w") as log:
        proc = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM did not start:\n{(root / 'vllm.log').read_text()}")
                time.sleep(0.5)
            body = {"model": "merged", "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                    "temperature": 0, "logprobs": 1, "prompt_logprobs": 0,
                    "return_token_ids": True, "ignore_eos": True}  # fmt: skip
            resp = httpx.post(
                f"{url}/v1/completions", json=body, timeout=120,
                headers={"Authorization": f"Bearer {API_KEY}"},
            )  # fmt: skip
        finally:
            _stop(proc)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    tokens, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    peft, base_dir = exported["peft"], exported["base"]
    # Greedy: PEFT picks the same tokens.
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        greedy = peft.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=8)
    assert tokens == greedy[0, len(PROMPT) :].tolist()
    want = logprobs_of(peft, tokens)
    gap = sum(abs(a - b) for a, b in zip(served, want, strict=True)) / len(tokens)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    base_gap = sum(abs(a - b) for a, b in zip(served, logprobs_of(base, tokens), strict=True))
    print(f"\nmerged in vLLM vs PEFT: mean logprob gap {gap:.2e}; vs base {base_gap / 8:.2e}")
    assert gap <= MAX_MEAN_GAP
    assert base_gap / len(tokens) >= MIN_BASE_GAP
    # The prompt's own logprobs (the first token has none): the same bound.
    prompt_lp = [next(iter(d.values()))["logprob"] for d in choice["prompt_logprobs"][1:]]
    with torch.no_grad():
        logp = torch.log_softmax(peft(torch.tensor([PROMPT])).logits[0], dim=-1)
    want_prompt = [logp[i - 1, t].item() for i, t in enumerate(PROMPT) if i > 0]
    prompt_gap = sum(abs(a - b) for a, b in zip(prompt_lp, want_prompt, strict=True))
    assert prompt_gap / len(want_prompt) <= MAX_MEAN_GAP
