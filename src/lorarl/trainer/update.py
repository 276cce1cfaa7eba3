"""One policy update on this rank's share of a step's samples.

Losses are normalized by *global* counts (tokens or sequences across all ranks and micro-batches)
and scaled by the world size, because FSDP averages gradients over ranks: the result equals the
loss of the whole batch aggregated once, however it is split.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from peft import PeftModel

from lorarl.trainer.advantages import to_token_advantages
from lorarl.trainer.batch import TensorBatch
from lorarl.trainer.logprobs import reference_logprobs, sequence_logprobs
from lorarl.trainer.losses import LossConfig, rl_loss
from lorarl.trainer.parallel import clip_grad_norm, set_gradient_sync


@dataclass(frozen=True)
class UpdateConfig:
    loss: LossConfig
    micro_batch_size: int
    mini_batches: int = 1
    epochs: int = 1
    grad_clip: float = 1.0
    # Samples may come from older weights than the trainer's (one-step off-policy): the ratio's
    # denominator is then the engines' logprobs, the policy that really generated them.
    behavior_from_rollout: bool = False
    # The engines' sampling temperature: every logprob pass scores softmax(logits / T).
    temperature: float = 1.0


def _all_reduce(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def _counts(batch: TensorBatch) -> tuple[float, float]:
    tokens = batch.response_mask.sum().item()
    seqs = (batch.response_mask.sum(-1) > 0).sum().item()
    return tokens, seqs


def _micro_batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def update_policy(
    model: PeftModel,
    optimizer: torch.optim.Optimizer,
    batch: TensorBatch,
    cfg: UpdateConfig,
) -> dict[str, float]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    token_level = cfg.loss.agg == "token-mean"
    adv_tok = to_token_advantages(batch.advantages, batch.response_mask)
    on_policy = cfg.mini_batches == 1 and cfg.epochs == 1
    mbs = cfg.micro_batch_size
    old = None
    if cfg.behavior_from_rollout:
        old = torch.where(batch.response_mask.bool(), batch.rollout_logprobs, 0.0)
    elif not on_policy:  # later mini-batches must see the policy that generated the samples
        with torch.no_grad():
            old, _ = sequence_logprobs(
                model, batch.input_ids, batch.attention_mask, batch.response_mask,
                micro_batch_size=mbs, temperature=cfg.temperature,
            )  # fmt: skip
    ref = None
    if cfg.loss.kl_coef > 0:
        ref = reference_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.response_mask,
            micro_batch_size=mbs, temperature=cfg.temperature,
        )  # fmt: skip

    sums: dict[str, float] = defaultdict(float)  # token-weighted metric sums on this rank
    grad_norms: list[float] = []
    minis = [
        slice(int(c[0]), int(c[-1]) + 1)
        for c in torch.arange(len(batch)).tensor_split(cfg.mini_batches)
        if len(c)
    ]
    for epoch in range(cfg.epochs):
        for mini in minis:
            part = batch.slice(mini)
            g_tokens, g_seqs = _all_reduce(list(_counts(part)))
            denominator = max(g_tokens if token_level else g_seqs, 1.0)
            optimizer.zero_grad(set_to_none=True)
            micros = _micro_batches(len(part), mbs)
            for i, mb in enumerate(micros):
                set_gradient_sync(model, i == len(micros) - 1)
                sub = part.slice(mb)
                lp, ent = sequence_logprobs(
                    model, sub.input_ids, sub.attention_mask, sub.response_mask,
                    micro_batch_size=mbs, with_entropy=True, temperature=cfg.temperature,
                )  # fmt: skip
                if cfg.loss.entropy_coef == 0:
                    ent = ent.detach()
                offset = mini.start + mb.start
                idx = slice(offset, offset + (mb.stop - mb.start))
                old_lp = lp.detach() if old is None else old[idx]
                loss, metrics = rl_loss(
                    lp, old_lp, adv_tok[idx], sub.response_mask, cfg.loss,
                    ref_logprobs=None if ref is None else ref[idx], entropy=ent,
                )  # fmt: skip
                tokens, seqs = _counts(sub)
                share = (tokens if token_level else seqs) / denominator
                (loss * share * world).backward()
                if epoch == 0:
                    _accumulate(sums, metrics, lp, sub, tokens)
            grad_norms.append(float(clip_grad_norm(model.parameters(), cfg.grad_clip)))
            optimizer.step()
    set_gradient_sync(model, True)
    return _finish(sums, grad_norms)


def _accumulate(sums, metrics, lp: torch.Tensor, sub: TensorBatch, tokens: float) -> None:
    mask = sub.response_mask
    sums["tokens"] += tokens
    sums["mismatch"] += ((sub.rollout_logprobs - lp.detach()).abs() * mask).sum().item()
    for key in ("policy_loss", "kl", "entropy", "clip_frac", "loss"):
        if key in metrics:
            sums[key] += float(metrics[key]) * tokens


def _finish(sums: dict[str, float], grad_norms: list[float]) -> dict[str, float]:
    keys = ["tokens", "mismatch", "policy_loss", "kl", "entropy", "clip_frac", "loss"]
    present = [k for k in keys if k in sums or k in ("tokens", "mismatch")]
    totals = dict(zip(present, _all_reduce([sums.get(k, 0.0) for k in present]), strict=True))
    tokens = max(totals.pop("tokens"), 1.0)
    out = {k: v / tokens for k, v in totals.items()}
    out["logprob_mismatch"] = out.pop("mismatch")
    out["grad_norm"] = grad_norms[-1] if grad_norms else 0.0
    out["trained_tokens"] = tokens
    return out
