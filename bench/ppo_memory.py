"""Memory of one PPO step with a LoRA critic: lorarl's shared base vs a second critic model.

    python -m bench.ppo_memory                  # SmolLM2-135M, 8 x 256 tokens, 3 repeats
    python -m bench.ppo_memory --repeats 2 --batch 4 --seq 128

Two ways to hold actor, reference and critic for PPO with LoRA:
- `lorarl`: one frozen base, the actor adapter ("default"), the critic adapter ("critic") and an
  fp32 value head (trainer/model/critic.py); the reference is the base with both adapters disabled.
- `separate`: what verl and SkyRL do with `critic.model.lora_rank`: the actor model (base + LoRA,
  its reference again the base with the adapter off) and a second full critic model (its own copy
  of the base + its own LoRA + a value head).

Each side runs in its own child process (pairs in ABBA order, `--repeats` pairs) that
builds its models, takes one warm-up PPO step on a tiny batch (so both AdamW optimizers hold
their moments), then
resets the kernel's peak-RSS counter (`/proc/self/clear_refs`) and takes the measured step:
reference, old logprobs and old values without grad; GAE; a clipped value-loss step on the
critic, then a clipped-surrogate step on the actor, each with a backward per micro-batch
(gradient accumulation, so one micro-batch's activations are alive at a time). Reported per
run: RSS before the step, peak RSS of the measured step, the step's seconds. CPU fp32 (this
machine has no GPU): on a GPU the same difference is one copy of the base weights in the training
dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import reset_peak_rss, rss_kib, trim_heap

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "ppo_memory.json"
MODEL = ROOT / ".cache" / "lorarl" / "models" / "SmolLM2-135M-Instruct"
SIDES = ("lorarl", "separate")


# ---------------------------------------------------------------- child


def _build(side: str, model_dir: Path, rank: int):
    """(actor model, critic model, values function); for lorarl both models are one object."""
    import torch
    from torch import nn

    from lorarl.trainer.model.critic import add_critic, critic_parameters, sequence_values
    from lorarl.trainer.model.loading import LoraSettings, apply_lora, load_base_model

    lora = LoraSettings(rank=rank, alpha=2.0 * rank)
    torch.manual_seed(0)
    actor = apply_lora(load_base_model(model_dir), lora)
    if side == "lorarl":
        add_critic(actor, lora)
        return actor, actor, sequence_values, critic_parameters(actor)
    critic = apply_lora(load_base_model(model_dir), lora)  # a second copy of the base
    critic.add_module("value_head", nn.Linear(critic.config.hidden_size, 1, dtype=torch.float32))
    nn.init.zeros_(critic.value_head.weight)
    nn.init.zeros_(critic.value_head.bias)
    decoder = critic.get_base_model().base_model

    def values(model, ids, attn, resp, *, micro_batch_size):
        from lorarl.trainer.model.logprobs import position_ids_from_mask

        out = []
        for s in range(0, ids.shape[0], micro_batch_size):
            i, a = ids[s : s + micro_batch_size], attn[s : s + micro_batch_size]
            h = decoder(input_ids=i, attention_mask=a, position_ids=position_ids_from_mask(a),
                        use_cache=False).last_hidden_state  # fmt: skip
            v = model.value_head(h[:, :-1].float()).squeeze(-1)
            out.append(torch.cat([v.new_zeros(v.shape[0], 1), v], dim=1))
        return torch.where(resp.bool(), torch.cat(out), 0.0)

    params = [(n, p) for n, p in critic.named_parameters() if p.requires_grad]
    return actor, critic, values, params


def _ppo_step(actor, critic, values_fn, actor_opt, critic_opt, batch, micro: int) -> None:
    """One PPO step's memory shape (the objective is PPO's; the data is random)."""
    import torch

    from lorarl.trainer.model.logprobs import reference_logprobs, sequence_logprobs
    from lorarl.trainer.model.parallel import clip_grad_norm

    ids, attn, resp, reward = batch
    mask = resp.float()
    with torch.no_grad():
        ref = reference_logprobs(actor, ids, attn, resp, micro_batch_size=micro)
        old, _ = sequence_logprobs(actor, ids, attn, resp, micro_batch_size=micro)
        old_v = values_fn(critic, ids, attn, resp, micro_batch_size=micro)
        last = mask.cumsum(1) == mask.sum(1, keepdim=True)
        rewards = torch.where(last & resp.bool(), reward[:, None], 0.0) - 0.05 * (old - ref) * mask
        adv = torch.zeros_like(old_v)
        gae = torch.zeros(ids.shape[0])
        for t in reversed(range(ids.shape[1])):  # gamma 1, lam 0.95
            nxt = old_v[:, t + 1] if t + 1 < ids.shape[1] else torch.zeros(ids.shape[0])
            gae = (rewards[:, t] + nxt - old_v[:, t] + 0.95 * gae) * mask[:, t]
            adv[:, t] = gae
        returns = adv + old_v
        adv = (adv - adv[resp.bool()].mean()) / (adv[resp.bool()].std() + 1e-8) * mask
    tokens = mask.sum()
    for s in range(0, ids.shape[0], micro):  # backward per micro-batch, as a trainer does
        sl = slice(s, s + micro)
        v = values_fn(critic, ids[sl], attn[sl], resp[sl], micro_batch_size=micro)
        clipped = old_v[sl] + (v - old_v[sl]).clamp(-0.5, 0.5)
        vloss = torch.max((v - returns[sl]) ** 2, (clipped - returns[sl]) ** 2)
        (0.5 * (vloss * mask[sl]).sum() / tokens).backward()
    clip_grad_norm([p for g in critic_opt.param_groups for p in g["params"]], 1.0)
    critic_opt.step()
    critic_opt.zero_grad(set_to_none=True)
    for s in range(0, ids.shape[0], micro):
        sl = slice(s, s + micro)
        lp, _ = sequence_logprobs(actor, ids[sl], attn[sl], resp[sl], micro_batch_size=micro)
        ratio = torch.exp(lp - old[sl])
        surrogate = torch.max(-adv[sl] * ratio, -adv[sl] * ratio.clamp(0.8, 1.2))
        ((surrogate * mask[sl]).sum() / tokens).backward()
    clip_grad_norm([p for g in actor_opt.param_groups for p in g["params"]], 1.0)
    actor_opt.step()
    actor_opt.zero_grad(set_to_none=True)


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lorarl.trainer.model.critic import actor_parameters

    torch.set_num_threads(args.threads)
    trim_heap()
    rss_start = rss_kib("VmRSS")
    actor, critic, values_fn, critic_params = _build(args.child, Path(args.model), args.rank)
    actor_opt = torch.optim.AdamW([p for _, p in actor_parameters(actor)], lr=1e-5)
    critic_opt = torch.optim.AdamW([p for _, p in critic_params], lr=1e-5)
    g = torch.Generator().manual_seed(0)
    vocab = actor.get_base_model().config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    attn = torch.ones_like(ids)
    resp = torch.zeros_like(ids)
    resp[:, args.seq // 4 :] = 1
    batch = (ids, attn, resp, torch.rand(args.batch, generator=g))
    tiny = tuple(t[:1, -16:] if t.dim() == 2 else t[:1] for t in batch)
    _ppo_step(actor, critic, values_fn, actor_opt, critic_opt, tiny, 1)  # optimizer state
    trim_heap()
    rss_built = rss_kib("VmRSS")
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    _ppo_step(actor, critic, values_fn, actor_opt, critic_opt, batch, args.micro)
    seconds = time.perf_counter() - t0
    peak = rss_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    n_params = sum(p.numel() for m in {id(actor): actor, id(critic): critic}.values()
                   for p in m.parameters())  # fmt: skip
    return {
        "side": args.child,
        "rss_start_mib": round(rss_start / 1024, 1),
        "rss_before_step_mib": round(rss_built / 1024, 1),
        "peak_rss_step_mib": round(peak / 1024, 1),
        "peak_is_step_only": reset,
        "step_seconds": round(seconds, 2),
        "parameters": n_params,
        "parameter_mib": round(n_params * 4 / 2**20, 1),  # fp32, resident or not
    }


# ---------------------------------------------------------------- parent


def run_side(side: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.ppo_memory", "--child", side, "--model", str(args.model),
           "--batch", str(args.batch), "--seq", str(args.seq), "--micro", str(args.micro),
           "--rank", str(args.rank), "--threads", str(args.threads)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{side} child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=SIDES)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    if not (args.model / "config.json").is_file():
        from lorarl.local.models import prepare_smollm2

        args.model = prepare_smollm2(args.model.parent)
    from bench.common import machine, write_results

    info = machine()
    runs: list[dict[str, Any]] = []
    for i in range(args.repeats):  # a report after every pair: an interrupted run keeps its pairs
        # ABBA: each side goes first in every other pair, so a warming (or loaded) machine
        # favours neither in the step times.
        runs += [run_side(side, args) for side in (SIDES if i % 2 == 0 else SIDES[::-1])]
        report = _report(args, info, runs)
        write_results(args.out, report)
    print(json.dumps({k: report[k] for k in ("summary_median", "peak_saved_mib")}, indent=2))
    return 0


def _report(args: argparse.Namespace, info: dict[str, Any], runs: list[dict[str, Any]]) -> dict:
    summary = {}
    for side in SIDES:
        mine = [r for r in runs if r["side"] == side]
        summary[side] = {
            key: round(statistics.median(r[key] for r in mine), 2)
            for key in ("parameter_mib", "rss_before_step_mib", "peak_rss_step_mib", "step_seconds")
        }
    saved = summary["separate"]["peak_rss_step_mib"] - summary["lorarl"]["peak_rss_step_mib"]
    info = {**info, "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}
    return {
        "benchmark": "ppo_memory",
        "machine": info,
        "method": __doc__,
        "settings": {
            "model": f"{args.model.name} (its real weights, fp32, CPU)",
            "batch": args.batch,
            "seq_len": args.seq,
            "response_tokens": args.seq - args.seq // 4,
            "micro_batch": args.micro,
            "lora_rank": args.rank,
            "critic_lora_rank": args.rank,
            "targets": "all-linear (actor and critic)",
            "threads": args.threads,
            "repeats": len(runs) // 2,
            "order": "ABBA: lorarl first in odd pairs, separate first in even ones",
        },
        "summary_median": summary,
        "peak_saved_mib": round(saved, 1),
        "peak_ratio_separate_over_lorarl": round(
            summary["separate"]["peak_rss_step_mib"] / summary["lorarl"]["peak_rss_step_mib"], 3
        ),
        "runs": runs,
    }


if __name__ == "__main__":
    sys.exit(main())
