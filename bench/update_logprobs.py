"""The policy update's logprob pass before and after issue 35 #6, on SmolLM2-135M.

    python -m bench.update_logprobs    # CPU, fp32; writes bench/results/update_logprobs.json

Before: every update built a full-vocabulary fp32 `log_softmax` (kept alive for the backward)
and the entropy's graph (`exp`, products over [B, T, V]) even with no entropy term. After: the
chunked logsumexp pass (`losses.chunked_logprobs`, a custom backward) with the entropy as a
detached metric computed in the same chunks. The two variants alternate within one run (the
"before" one is the old function, patched in), on the same synthetic batch, so the machine's
load skews neither. Also counted once per variant, outside the timing: the fp32 memory the
update allocated in tensors over the vocabulary (the LM head's output and its gradient
included), via a dispatch mode that sees every new storage: the peak held at once.
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from bench.common import machine, write_results
from bench.trainer_step import synthetic_batch
from lorarl.trainer.model import logprobs
from lorarl.trainer.rl.losses import LossConfig
from lorarl.trainer.update.actor import UpdateConfig, update_policy

RESULTS = Path(__file__).parent / "results" / "update_logprobs.json"
COMMAND = "python -m bench.update_logprobs"


def _before(logits, input_ids, with_entropy, first=1, temperature=1.0, *, entropy_grad=False):
    """`logprobs.token_logprobs_from_logits` as it was: a full fp32 log-softmax and, whenever
    the entropy is asked for, its graph (the update detached it afterwards)."""
    scaled = logits[:, :-1].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    picked = logp.gather(-1, input_ids[:, first:].unsqueeze(-1)).squeeze(-1)
    zeros = picked.new_zeros(picked.shape[0], first)
    out = torch.cat([zeros, picked], dim=1)
    if not with_entropy:
        return out, None
    entropy = -(logp.exp() * logp).sum(-1)
    return out, torch.cat([zeros, entropy], dim=1)


@contextmanager
def variant(name: str) -> Iterator[None]:
    original = logprobs.token_logprobs_from_logits
    if name == "before":
        logprobs.token_logprobs_from_logits = _before
    try:
        yield
    finally:
        logprobs.token_logprobs_from_logits = original


class _VocabBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak of the fp32 memory held at once in tensors over the vocabulary (new storages only:
    views and parameters do not count; a tensor counts until it is freed)."""

    def __init__(self, vocab: int, params) -> None:
        super().__init__()
        self.vocab, self.live, self.peak = vocab, 0, 0
        self.seen = {p.untyped_storage().data_ptr() for p in params}

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() < 2:
                continue
            s = t.untyped_storage()
            if t.shape[-1] == self.vocab and s.data_ptr() not in self.seen:
                self.seen.add(s.data_ptr())
                self.live += s.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, s.nbytes())
        return out


def measure(model_dir: Path, samples: int, prompt: int, completion: int, reps: int) -> dict:
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=32, lora_alpha=32, target_modules="all-linear"))
    vocab = model.config.vocab_size
    batch = synthetic_batch(vocab, samples, prompt, completion)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    cfg = UpdateConfig(LossConfig(), micro_batch_size=samples)  # entropyCoef 0 (the default)
    times: dict[str, list[float]] = {"before": [], "after": []}
    entropy: dict[str, float] = {}
    for i in range(reps + 1):  # the first pair is warm-up
        for name in ("before", "after"):
            with variant(name):
                t0 = time.perf_counter()
                metrics = update_policy(model, opt, batch, cfg)
                elapsed = time.perf_counter() - t0
            if i:
                times[name].append(elapsed)
            entropy[name] = metrics["entropy"]
    memory = {}
    for name in ("before", "after"):
        with variant(name), _VocabBytes(vocab, model.parameters()) as seen:
            update_policy(model, opt, batch, cfg)
        memory[name] = {"peak_fp32_vocab_mb": round(seen.peak / 2**20, 1)}
    before, after = statistics.median(times["before"]), statistics.median(times["after"])
    return {
        "batch": {
            "samples": samples,
            "prompt": prompt,
            "completion": completion,
            "micro": samples,
            "vocab": vocab,
        },
        "update_s_before": round(before, 4),
        "update_s_after": round(after, 4),
        "speedup": round(before / after, 3),
        "update_s_before_all": [round(t, 4) for t in times["before"]],
        "update_s_after_all": [round(t, 4) for t in times["after"]],
        "entropy_metric_before": round(entropy["before"], 6),
        "entropy_metric_after": round(entropy["after"], 6),
        "memory_before": memory["before"],
        "memory_after": memory["after"],
        "reps": reps,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from harness.workloads.pretrained import smollm2

    model_dir = smollm2()
    records = [
        measure(model_dir, samples=4, prompt=32, completion=32, reps=args.reps),
        measure(model_dir, samples=4, prompt=32, completion=256, reps=args.reps),
    ]
    report = {
        "machine": machine(),
        "command": COMMAND,
        "model": "SmolLM2-135M-Instruct (float32, LoRA r=32 all-linear), CPU",
        "records": records,
    }
    write_results(args.out, report)
    print(f"wrote {args.out}")
    for r in records:
        print(r["batch"], r["update_s_before"], "->", r["update_s_after"], r["memory_before"],
              r["memory_after"])  # fmt: skip


if __name__ == "__main__":
    main()
