"""Issue 13 against SGLang 0.5.23's own code (in `.venv-sglang`): the logprobs it returns are those
of the temperature-scaled distribution under the env lorarl starts it with, and the adapter the
sidecar writes is scaled by SGLang exactly as the trainer scales it (rsLoRA included)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from lorarl.plan.engines import engine_env
from lorarl.rollout.applier import served_adapter_config
from lorarl.sync.adapter_files import write_adapter_dir
from lorarl.sync.buckets import SyncHeader
from lorarl.sync.merge import lora_scaling
from tests.contract.conftest import sglang_python
from tests.unit.trainer.rl.test_rl_spec import make

STUBS = Path(__file__).resolve().parent / "sglang_stubs"


def run_in_sglang(code: str, env: dict[str, str] | None = None) -> dict:
    python = sglang_python()
    if not python.exists():
        pytest.skip(f"SGLang contract env not found at {python}: build it with `make sglang-venv`")
    prelude = f"import sys, json; sys.path.insert(0, {str(STUBS)!r})\n"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    out = subprocess.run(
        [str(python), "-W", "ignore", "-c", prelude + code],
        env={**clean, **(env or {})}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


SAMPLER_FLAGS = """
import inspect
from sglang.srt.layers import sampler
from sglang.srt.environ import envs
src = inspect.getsource(sampler.Sampler.forward)
print(json.dumps({
    "sampler": sampler.SGLANG_RETURN_ORIGINAL_LOGPROB,
    "envs": envs.SGLANG_RETURN_ORIGINAL_LOGPROB.get(),
    "scales_before_logprobs": "logits.div_(sampling_info.temperatures)" in src
        and "torch.log(probs)" in src,
}))
"""


def test_sglang_returns_post_temperature_logprobs_under_lorarls_engine_env():
    """The trainer scores softmax(z / T): SGLang must not return the raw distribution, even if
    an image sets SGLANG_RETURN_ORIGINAL_LOGPROB (the engine's own env wins over the image's)."""
    env = engine_env(make(rollout={"engine": "sglang"}).spec)
    ours = run_in_sglang(SAMPLER_FLAGS, {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", **env})
    assert ours == {"sampler": False, "envs": False, "scales_before_logprobs": True}
    flipped = run_in_sglang(SAMPLER_FLAGS, {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"})
    assert flipped["sampler"] is True  # the variable is live: pinning it matters


@pytest.mark.parametrize("use_rslora", [True, False])
def test_sglang_scales_the_served_adapter_like_the_trainer(tmp_path: Path, use_rslora: bool):
    """Issue 13 #3: SGLang's LoRAConfig reads r and lora_alpha only (scaling alpha/r); with
    rsLoRA the served delta was sqrt(r) too small (5.66x at r=32)."""
    rank, alpha = 32, 16.0
    module = "model.layers.0.self_attn.q_proj"
    header = SyncHeader(
        version=1, mode="adapter", scaling=lora_scaling(alpha, rank, use_rslora), rank=rank,
        alpha=alpha, use_rslora=use_rslora, target_modules=(module,),
    )  # fmt: skip
    prefix = f"base_model.model.{module}"
    tensors = {f"{prefix}.lora_A.weight": torch.zeros(rank, 64),
               f"{prefix}.lora_B.weight": torch.zeros(64, rank)}  # fmt: skip
    folder = tmp_path / "adapter"
    write_adapter_dir(tensors, served_adapter_config(header, tmp_path), folder)
    got = run_in_sglang(
        "from sglang.srt.lora.lora_config import LoRAConfig\n"
        f"c = LoRAConfig({str(folder)!r})\n"
        "print(json.dumps({'scaling': c.lora_alpha / c.r, 'r': c.r}))"
    )
    assert got["r"] == rank
    assert got["scaling"] == pytest.approx(header.scaling, rel=1e-12)
    want = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    assert header.scaling == pytest.approx(want)
