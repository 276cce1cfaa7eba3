"""Peak memory of one policy update with the trainer's memory features on and off.

    python -m bench.trainer_memory                       # SmolLM2-135M, 8 samples of 128-512
    python -m bench.trainer_memory --model DIR --batch 4 --seq 256

Configurations (each in its own child process, fp32 on CPU, one thread, glibc's mmap threshold
fixed so that RSS follows the live tensors: `bench.common.LIVE_TENSORS_MALLOC`):
- `plain`: one micro-batch of the whole batch (`--micro` = batch), no checkpointing;
- `checkpointing`: the same with trainer.activationCheckpointing (every decoder layer recomputed
  in the backward, `trainer/model/memory.py`);
- `token_budget`: the same batch with training.maxTokensPerMicroBatch = `--max-tokens`
  (`trainer/model/micro_batches.py`);
- `both`: checkpointing and the token budget.

The child loads the model, wraps it with LoRA (r=16, all-linear), takes one warm-up update on a
one-sample batch, trims the heap, resets the kernel's peak-RSS counter (`/proc/self/clear_refs`)
and runs `update.update_policy` once (token-mean loss, a KL term so the reference pass runs
too). Reported: RSS before the update, its peak, the peak above the start (the update's own
memory: activations, logits, gradients), seconds. The samples' lengths are spread evenly from
seq/4 to seq (prompt 32 tokens), as an RL batch's are. Writes bench/results/trainer_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import LIVE_TENSORS_MALLOC, reset_peak_rss, rss_kib, trim_heap

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / ".cache" / "lorarl" / "models" / "SmolLM2-135M-Instruct"
CONFIGS = {
    "plain": (False, False),
    "checkpointing": (True, False),
    "token_budget": (False, True),
    "both": (True, True),
}
PROMPT = 32


def lengths(batch: int, seq: int) -> list[int]:
    """Sample lengths spread evenly from seq/4 to seq, longest last."""
    lo = max(seq // 4, PROMPT + 2)
    return [lo + (seq - lo) * i // max(batch - 1, 1) for i in range(batch)]


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lorarl.trainer.model.loading import LoraSettings, apply_lora, load_base_model
    from lorarl.trainer.model.memory import checkpoint_layers
    from lorarl.trainer.rl.losses import LossConfig
    from lorarl.trainer.rl.samples import TrainSample
    from lorarl.trainer.update.actor import UpdateConfig, update_policy
    from lorarl.trainer.update.batch import collate

    torch.set_num_threads(args.threads)
    checkpointing, budget = CONFIGS[args.child]
    torch.manual_seed(0)
    model = apply_lora(load_base_model(args.model), LoraSettings(rank=16, alpha=32.0))
    if checkpointing:
        checkpoint_layers(model)
    vocab = model.get_base_model().config.vocab_size
    g = torch.Generator().manual_seed(0)

    def sample(n: int, adv: float) -> TrainSample:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        return TrainSample(ids[:PROMPT], ids[PROMPT:], [-2.0] * (n - PROMPT), adv, 0.0, 0)

    batch = collate(
        [sample(n, (-1.0) ** i) for i, n in enumerate(lengths(args.batch, args.seq))], 0
    )
    cfg = UpdateConfig(
        LossConfig(kl_coef=0.01),
        micro_batch_size=args.batch,
        max_tokens=args.max_tokens if budget else None,
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    update_policy(model, opt, collate([sample(PROMPT + 4, 1.0)], 0), cfg)  # optimizer state
    trim_heap()
    before = rss_kib("VmRSS")
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    update_policy(model, opt, batch, cfg)
    seconds = time.perf_counter() - t0
    peak = rss_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "config": args.child,
        "rss_before_mib": round(before / 1024, 1),
        "peak_rss_mib": round(peak / 1024, 1),
        "update_peak_mib": round((peak - before) / 1024, 1),
        "peak_is_update_only": reset,
        "seconds": round(seconds, 2),
    }


def run_config(
    name: str, model: Path, batch: int, seq: int, max_tokens: int, threads: int = 1
) -> dict[str, Any]:
    """One configuration in a fresh child whose RSS follows its live tensors (bench/common.py)."""
    cmd = [sys.executable, "-m", "bench.trainer_memory", "--child", name, "--model", str(model),
           "--batch", str(batch), "--seq", str(seq), "--max-tokens", str(max_tokens),
           "--threads", str(threads)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    env |= LIVE_TENSORS_MALLOC
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} child failed:\n{proc.stderr[-4000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=list(CONFIGS))
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "trainer_memory.json",
                   help="results file (the default is the committed one)")  # fmt: skip
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    if not (args.model / "config.json").is_file():
        from lorarl.local.models import prepare_smollm2

        args.model = prepare_smollm2(args.model.parent)
    from bench.common import machine, write_results

    runs = [
        run_config(name, args.model, args.batch, args.seq, args.max_tokens, args.threads)
        for name in args.configs.split(",")
    ]
    report = {"benchmark": "trainer_memory", "method": __doc__, "machine": machine(),
              "settings": {"model": args.model.name, "batch": args.batch, "seq": args.seq,
                           "max_tokens": args.max_tokens, "threads": args.threads},
              "runs": runs}  # fmt: skip
    print(json.dumps(report["runs"], indent=2))
    if args.out is not None:
        write_results(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
