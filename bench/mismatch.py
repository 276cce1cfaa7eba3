"""Logprob mismatch of the served policy per sync mode in bf16: `python -m bench.mismatch`.

What a bf16 engine computes is simulated with transformers/PEFT on CPU (no engine runs here in
bf16): `merged` serves `bf16(W + s·B@A)`, `adapter` serves `bf16(W)` plus the LoRA path in bf16,
as the sidecar's two modes deliver them. The trainer's policy is the fp32 PEFT model. A LoRA
delta of relative size `delta` (Frobenius norm of s·B@A over that of W, per module; ~1e-3 is a
few RL steps at lr 1e-5) is drawn at random. Measured on teacher-forced random token sequences:
- `mismatch_mean`: mean |served logprob - trainer fp32 logprob| per token;
- `update_error`: ||(served - served base) - (trainer - trainer base)|| / ||trainer - base||
  over the logprobs: how much of the *update* reaches the served policy (0: all of it; 1: none).
Writes bench/results/mismatch.json.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from bench.common import machine, write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "mismatch.json"


def _logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def _set_delta(peft_model, delta: float, gen: torch.Generator) -> None:
    """Random LoRA factors whose update s·B@A has norm `delta` * ||W|| in every module."""
    for module in peft_model.modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        s = module.scaling["default"]
        with torch.no_grad():
            a.copy_(torch.randn(a.shape, generator=gen) / a.shape[1] ** 0.5)
            b.copy_(torch.randn(b.shape, generator=gen))
            update = s * (b @ a)
            b.mul_(delta * module.base_layer.weight.norm() / update.norm())


def measure(model_dir: Path, delta: float, n_seq: int, seq_len: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, base.config.vocab_size, (n_seq, seq_len), generator=gen)
    base_lp = _logprobs(base, ids)
    policy = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    ).eval()
    _set_delta(policy, delta, gen)
    trainer = _logprobs(policy, ids)
    true_update = trainer - base_lp
    base16_lp = _logprobs(copy.deepcopy(base).to(torch.bfloat16), ids)
    served = {
        "merged": copy.deepcopy(policy).merge_and_unload().to(torch.bfloat16),
        "adapter": copy.deepcopy(policy).to(torch.bfloat16),
    }
    out = {}
    for mode, model in served.items():
        lp = _logprobs(model.eval(), ids)
        update = lp - base16_lp
        out[mode] = {
            "mismatch_mean": float((lp - trainer).abs().mean()),
            "mismatch_p99": float((lp - trainer).abs().flatten().quantile(0.99)),
            "update_error": float((update - true_update).norm() / true_update.norm()),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deltas", type=float, nargs="+", default=[1e-3, 1e-2])
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--len", type=int, default=64)
    args = parser.parse_args()
    from lorarl.local.models import prepare_smollm2, prepare_tiny_llama

    models = {"tiny-llama": prepare_tiny_llama(), "SmolLM2-135M": prepare_smollm2()}
    report = {"machine": machine(), "method": __doc__, "results": {}}
    for name, path in models.items():
        for delta in args.deltas:
            key = f"{name} delta={delta:g}"
            report["results"][key] = measure(Path(path), delta, args.seqs, args.len, seed=0)
            print(key, report["results"][key], flush=True)
    write_results(RESULTS, report)


if __name__ == "__main__":
    main()
