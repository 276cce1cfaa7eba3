"""Tokens/s of one GRPO policy update on a fixed batch (the trainer's `update_policy`).

    python -m bench.trainer_step            # tiny Llama + SmolLM2-135M on this machine
    python -m bench.trainer_step --gpu      # + a Qwen2-shaped ~0.5B model in bf16 (needs CUDA)

The batch is synthetic (random token ids, fixed seed) so every run measures the same work:
`samples` sequences of `prompt` + `completion` tokens, one forward with grad for the policy, no
reference pass (KL off), AdamW on the LoRA parameters.

Each model is also measured with the LM head over every position (`full_head_step_s`), the way
the trainer computed logprobs before it kept only completion positions; the two variants
alternate within one run so the ratio is not skewed by the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen2Config

from bench.common import machine, write_results
from lorarl.trainer.model import logprobs
from lorarl.trainer.rl.losses import LossConfig
from lorarl.trainer.rl.samples import TrainSample
from lorarl.trainer.update.actor import UpdateConfig, update_policy
from lorarl.trainer.update.batch import collate

RESULTS = Path(__file__).parent / "results" / "trainer_step.json"
H100_BF16_DENSE_FLOPS = 989e12


def synthetic_batch(vocab: int, samples: int, prompt: int, completion: int):
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(samples):
        ids = torch.randint(10, vocab, (prompt + completion,), generator=g).tolist()
        rows.append(
            TrainSample(ids[:prompt], ids[prompt:], [-1.0] * completion, float(i % 2) - 0.5, 0.0, 0)
        )
    return collate(rows, pad_id=0)


@contextmanager
def full_sequence_head() -> Iterator[None]:
    """The trainer before completion-only logits: score from column 1, i.e. every position."""
    original = logprobs.first_scored_position
    logprobs.first_scored_position = lambda response_mask: 1
    try:
        yield
    finally:
        logprobs.first_scored_position = original


def _timed_update(model, opt, batch, cfg, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    update_policy(model, opt, batch, cfg)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(name, model, device, samples, prompt, completion, micro, reps=3) -> dict:
    model = get_peft_model(model, LoraConfig(r=32, lora_alpha=32, target_modules="all-linear"))
    model.to(device)
    batch = synthetic_batch(model.config.vocab_size, samples, prompt, completion)
    batch = type(batch)(*(t.to(device) for t in vars(batch).values()))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    cfg = UpdateConfig(LossConfig(), micro_batch_size=micro)
    times, full_times = [], []
    for i in range(reps + 1):  # the first pair is warm-up
        t = _timed_update(model, opt, batch, cfg, device)
        with full_sequence_head():
            t_full = _timed_update(model, opt, batch, cfg, device)
        if i:
            times.append(t)
            full_times.append(t_full)
    step_s = statistics.median(times)
    tokens = samples * (prompt + completion)
    params = sum(p.numel() for p in model.parameters())
    record = {
        "model": name,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "params": params,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "batch": {"samples": samples, "prompt": prompt, "completion": completion, "micro": micro},
        "step_s": round(step_s, 4),
        "full_head_step_s": round(statistics.median(full_times), 4),
        "completion_head_speedup": round(statistics.median(full_times) / step_s, 3),
        "tokens_per_s": round(tokens / step_s, 1),
        "reps": reps,
    }
    if device.type == "cuda":  # forward 2N + input-gradient backward 2N flops per token
        record["mfu"] = round(4 * params * tokens / step_s / H100_BF16_DENSE_FLOPS, 4)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="also run the bf16 ~0.5B model on CUDA")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from harness.workloads.pretrained import smollm2
    from harness.workloads.tiny_models import tiny_config

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    records = [
        measure(
            "tiny-llama-2L-128h",
            AutoModelForCausalLM.from_config(tiny_config("llama")),
            cpu,
            samples=16,
            prompt=32,
            completion=32,
            micro=16,
        ),
        measure(
            "SmolLM2-135M-Instruct",
            AutoModelForCausalLM.from_pretrained(smollm2(), dtype=torch.float32),
            cpu,
            samples=4,
            prompt=32,
            completion=32,
            micro=4,
        ),
    ]
    if args.gpu:
        config = Qwen2Config(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
        )
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        records.append(
            measure(
                "qwen2-0.5b-shaped-random",
                model,
                torch.device("cuda"),
                samples=64,
                prompt=256,
                completion=256,
                micro=8,
            )
        )
    write_results(args.out, {"machine": machine(), "records": records})
    for r in records:
        print(
            f"{r['model']:28s} {r['device']:10s} {r['step_s']:8.3f} s/step "
            f"{r['tokens_per_s']:10.1f} tok/s  (full-sequence head {r['full_head_step_s']:.3f} s)"
        )


if __name__ == "__main__":
    main()
