"""lorarl.engines: pure values, and the facts other packages rely on."""

from __future__ import annotations

import subprocess
import sys

from lorarl.engines import sglang, vllm
from lorarl.engines.flags import managed_flags


def test_engines_import_nothing_with_io():
    """The plan, the operator's admission and the status API import it: no torch, no HTTP."""
    code = (
        "import sys, lorarl.engines.flags, lorarl.engines.vllm, lorarl.engines.sglang\n"
        "bad = [m for m in ('torch', 'httpx', 'pydantic') if m in sys.modules]\n"
        "bad += [m for m in sys.modules if m.startswith('lorarl.') and"
        " not m.startswith('lorarl.engines')]\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_one_health_path_serves_both_engines():
    """The trainer's liveness probe asks every engine the same path."""
    assert vllm.HEALTH == sglang.HEALTH


def test_sglang_args_name_only_managed_flags():
    args = sglang.sglang_server_args(
        "/m", "127.0.0.1", 30000, served_model_name="base", dtype="bfloat16",
        tensor_parallel_size=1, mem_fraction_static=0.85, seed=0, api_key="k",
        trust_remote_code=True, lora_rank=16, lora_target_modules=("all-linear",),
        memory_saver=True,
    )  # fmt: skip
    assert args[args.index("--lora-target-modules") + 1] == "all"
    managed = set(managed_flags("sglang", cpu=False))
    assert {a for a in args if a.startswith("--")} <= managed


def test_vllm_cpu_args_name_only_managed_flags():
    args = vllm.vllm_server_args(
        "/m",
        "127.0.0.1",
        8000,
        served_model_name="base",
        max_model_len=64,
        max_lora_rank=16,
        sleep_mode=True,
    )
    assert args[args.index("--max-num-batched-tokens") + 1] == str(vllm.VLLM_CPU_MAX_NUM_SEQS * 64)
    assert {a for a in args if a.startswith("--")} <= set(managed_flags("vllm", cpu=True))
