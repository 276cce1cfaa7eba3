"""The memory plan's estimate (`lorarl plan --memory`, plan/memory.py) against measured peaks.

    python -m bench.memory_plan                  # tiny Llama and SmolLM2-135M, ~2 min here
    python -m bench.memory_plan --only tiny

Each configuration runs in its own child process (CPU, fp32, as a CPU trainer runs; one rank, so
nothing is sharded): it notes its RSS after importing torch and transformers, loads the model,
wraps it with LoRA (r=16, all-linear), takes one warm-up update (AdamW's moments exist), trims
the heap and notes RSS again: the difference is the measured *resident* state, compared with the
estimate's base weights + LoRA parameters + AdamW state. It then resets the kernel's peak-RSS
counter (`/proc/self/clear_refs`) and runs `update.update_policy` on `rows` sequences of `seq`
tokens (prompt `seq/4`) as one micro-batch: the peak above the RSS before it is the measured
*update* memory, compared with the estimate's activations + logits (+ gradient) + LoRA
gradients for the same micro-batch, with and without activation checkpointing. RSS deltas
leave out the Python/torch baseline. Each configuration runs twice: with glibc's default
allocator (RSS also holds freed activations the heap keeps) and with a fixed 64 KiB mmap
threshold (RSS follows the live tensors: `MALLOC`). The estimate reads only config.json (the
model on the meta device).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import LIVE_TENSORS_MALLOC, reset_peak_rss, rss_kib, trim_heap

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "memory_plan.json"
MODELS = ROOT / ".cache" / "lorarl" / "models"
# name -> (model folder, rows, seq)
MODEL_RUNS = {
    "tiny": ("tiny-llama-letters", 16, 512),
    "smollm2": ("SmolLM2-135M-Instruct", 4, 256),
}
RANK = 16
# How glibc is set up in the child: its default (large freed tensors stay in the heap once its
# dynamic mmap threshold has grown, so RSS also counts that slack), or RSS following the live
# tensors (bench/common.py), which is what the estimate models and what a caching GPU allocator
# holds.
MALLOC = {"glibc_default": {}, "mmap_64k": LIVE_TENSORS_MALLOC}


def measure(model_dir: Path, rows: int, seq: int, checkpointing: bool) -> dict[str, float]:
    """The measured resident and update memory (MiB) of one configuration, in this process."""
    import torch

    from lorarl.trainer.model.loading import LoraSettings, apply_lora, load_base_model
    from lorarl.trainer.model.memory import checkpoint_layers
    from lorarl.trainer.rl.losses import LossConfig
    from lorarl.trainer.rl.samples import TrainSample
    from lorarl.trainer.update.actor import UpdateConfig, update_policy
    from lorarl.trainer.update.batch import collate

    torch.manual_seed(0)
    trim_heap()
    start = rss_kib("VmRSS")
    model = apply_lora(load_base_model(model_dir), LoraSettings(rank=RANK, alpha=2.0 * RANK))
    if checkpointing:
        checkpoint_layers(model)
    vocab = model.get_base_model().config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = seq // 4

    def sample(n: int) -> TrainSample:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        return TrainSample(ids[:prompt], ids[prompt:], [-2.0] * (n - prompt), 1.0, 0.0, 0)

    cfg = UpdateConfig(LossConfig(), micro_batch_size=rows)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    update_policy(model, opt, collate([sample(prompt + 4)], 0), cfg)  # optimizer state
    batch = collate([sample(seq) for _ in range(rows)], 0)
    trim_heap()
    before = rss_kib("VmRSS")
    if not reset_peak_rss():
        raise SystemExit("cannot reset the peak RSS (/proc/self/clear_refs): no measurement")
    t0 = time.perf_counter()
    update_policy(model, opt, batch, cfg)
    seconds = time.perf_counter() - t0
    peak = rss_kib("VmHWM")
    return {
        "resident_mib": round((before - start) / 1024, 1),
        "update_mib": round((peak - before) / 1024, 1),
        "update_seconds": round(seconds, 2),
    }


def estimate(model_dir: Path, rows: int, seq: int, checkpointing: bool) -> dict[str, float]:
    """The plan's figures (MiB) for the same configuration: one fp32 CPU rank."""
    from lorarl.model_checks import model_shape
    from lorarl.plan.memory import MIB, Settings, read_config, trainer_memory
    from lorarl.trainer.model.loading import LoraSettings

    shape = model_shape(read_config(model_dir), LoraSettings(rank=RANK, alpha=2.0 * RANK))
    s = Settings(
        world=1, gpu=False, weight_bytes=4, compute_bytes=4, rows=rows, seq=seq,
        response=seq - seq // 4, checkpointing=checkpointing, offload=False, tensor_parallel=1,
        engine_gpu=False, memory_fraction=0.85, kv_cache_bytes=0, colocated=False,
    )  # fmt: skip
    t = trainer_memory(shape, s)
    return {
        "resident_mib": round(t.resident / MIB, 1),
        "update_mib": round(t.update_transient / MIB, 1),
        "activations_mib": round(t.activations / MIB, 1),
        "logits_mib": round(t.logits / MIB, 1),
    }


def run_child(name: str, checkpointing: bool, threads: int, malloc: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.memory_plan", "--child", name, "--threads", str(threads)]
    if checkpointing:
        cmd.append("--checkpointing")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    env |= MALLOC[malloc]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{name} child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=list(MODEL_RUNS))
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", nargs="*", choices=list(MODEL_RUNS))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        folder, rows, seq = MODEL_RUNS[args.child]
        print(json.dumps(measure(MODELS / folder, rows, seq, args.checkpointing)), flush=True)
        return 0
    from bench.common import machine, write_results

    if not (MODELS / "tiny-llama-letters" / "config.json").is_file():
        from lorarl.local.models import prepare_tiny_llama

        prepare_tiny_llama(MODELS)
    if not (MODELS / "SmolLM2-135M-Instruct" / "config.json").is_file():
        from lorarl.local.models import prepare_smollm2

        prepare_smollm2(MODELS)
    runs = []
    for name in args.only or list(MODEL_RUNS):
        folder, rows, seq = MODEL_RUNS[name]
        for ckpt in (False, True):
            est = estimate(MODELS / folder, rows, seq, ckpt)
            for malloc in MALLOC:
                got = run_child(name, ckpt, args.threads, malloc)
                runs.append({
                    "model": folder, "rows": rows, "seq": seq, "checkpointing": ckpt,
                    "malloc": malloc, "estimate": est, "measured": got,
                    "update_ratio": round(est["update_mib"] / got["update_mib"], 3),
                    "resident_ratio": round(est["resident_mib"] / got["resident_mib"], 3),
                })  # fmt: skip
                print(json.dumps(runs[-1]), flush=True)
    report = {
        "benchmark": "memory_plan",
        "what": "estimate (plan/memory.py, config.json only) vs measured RSS deltas of one "
        "LoRA policy update, CPU fp32, one rank; ratio = estimate / measured; malloc "
        "mmap_64k: RSS follows the live tensors, glibc_default: plus the heap's slack",
        "machine": machine(threads=args.threads),
        "runs": runs,
    }
    write_results(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
