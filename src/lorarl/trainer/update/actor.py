"""One policy update on this rank's share of a step's samples: the actor's loss, its micro-batch
plan and metrics; the optimizer steps are `steps.gradient_steps`, shared with the critic.

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

from lorarl.trainer.model.logprobs import (
    adapter_reference_logprobs,
    reference_logprobs,
    sequence_logprobs,
)
from lorarl.trainer.model.micro_batches import max_over_ranks, row_lengths, token_micro_batches
from lorarl.trainer.rl.advantages import to_token_advantages
from lorarl.trainer.rl.losses import LossConfig, rl_loss
from lorarl.trainer.update.batch import TensorBatch
from lorarl.trainer.update.steps import (
    Micro,
    MicroPlan,
    Objective,
    all_reduce_sum,
    gradient_steps,
)


@dataclass(frozen=True)
class UpdateConfig:
    loss: LossConfig
    micro_batch_size: int
    mini_batches: int = 1
    epochs: int = 1
    grad_clip: float = 1.0
    # Samples may come from older weights than the trainer's (one-step off-policy). Without a
    # correction the ratio's denominator is the engines' logprobs (the policy that generated
    # them); with one it is the trainer's policy at the start of the step (decoupled PPO: clip
    # around the current weights) and the correction weighs that against the engines'.
    behavior_from_rollout: bool = False
    # The engines' sampling temperature: every logprob pass scores softmax(logits / T).
    temperature: float = 1.0
    # training.maxTokensPerMicroBatch: micro-batches also cut by rows x longest <= this
    # (`micro_batches`); None: by micro_batch_size alone.
    max_tokens: int | None = None


def reference_pass(
    model: PeftModel,
    batch: TensorBatch,
    cfg: UpdateConfig,
    reference: dict[str, torch.Tensor] | None,
) -> torch.Tensor:
    """KL reference logprobs: the base (adapter disabled) or a frozen adapter snapshot."""
    args = (batch.input_ids, batch.attention_mask, batch.response_mask)
    mbs, temperature, max_tokens = cfg.micro_batch_size, cfg.temperature, cfg.max_tokens
    if reference is None:
        return reference_logprobs(
            model, *args, micro_batch_size=mbs, temperature=temperature, max_tokens=max_tokens
        )
    return adapter_reference_logprobs(
        model, reference, *args,
        micro_batch_size=mbs, temperature=temperature, max_tokens=max_tokens,
    )  # fmt: skip


def _counts(batch: TensorBatch) -> tuple[float, float]:
    tokens = batch.response_mask.sum().item()
    seqs = (batch.response_mask.sum(-1) > 0).sum().item()
    return tokens, seqs


def micro_batch_slices(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def gradient_free(batch: TensorBatch, cfg: UpdateConfig) -> torch.Tensor | None:
    """[B] bool: the samples that add exactly nothing to the gradient; None when none can be
    told apart (a KL or entropy term, or per-token advantages).

    With neither term, a sample's loss is its advantage times a (clipped) ratio: a sample whose
    advantage is exactly 0 (a GRPO group whose rewards were all equal) or that scores no token
    (overlong-masked, a rank's filler) contributes 0 with a gradient of exactly 0. The update
    skips its forward and backward but keeps it in the loss's denominators, so the gradient is
    the same; the per-token metrics (entropy, clip fraction, logprob mismatch) then cover the
    samples that were trained on.
    """
    if cfg.loss.kl_coef > 0 or cfg.loss.entropy_coef > 0 or batch.token_advantages is not None:
        return None
    return (batch.advantages == 0) | (batch.response_mask.sum(-1) == 0)


def rows_to_train(
    attention_mask: torch.Tensor, skip: torch.Tensor | None, micro_batch_size: int
) -> torch.Tensor:
    """The rows of a mini-batch to run, shortest first (`by_length`): all of them, or those not
    in `skip`. FSDP2 forwards are collective, so every rank runs as many micro-batches as the
    rank with the most rows to train (at least one): a rank short of them tops up with its
    shortest skipped rows, which add nothing."""
    if skip is None:
        return by_length(attention_mask, micro_batch_size)
    kept, dropped = (~skip).nonzero().squeeze(-1), skip.nonzero().squeeze(-1)
    micros = torch.tensor([-(-len(kept) // micro_batch_size)], dtype=torch.long)
    if dist.is_initialized():
        dist.all_reduce(micros, op=dist.ReduceOp.MAX)
    need = max(len(kept), (max(int(micros), 1) - 1) * micro_batch_size + 1)
    lengths = attention_mask.sum(-1)
    filler = dropped[torch.argsort(lengths[dropped], stable=True)][: need - len(kept)]
    rows = torch.cat([kept, filler])
    return rows[by_length(attention_mask[rows], micro_batch_size)]


def plan_micro_batches(
    mini: TensorBatch, skip: torch.Tensor | None, cfg: UpdateConfig
) -> list[tuple[torch.Tensor, float]]:
    """A mini-batch's micro-batches as (rows in `mini`, loss weight), the same number on every
    rank (collective). By `micro_batch_size` (`rows_to_train`), or, with `cfg.max_tokens`, by
    the token budget too (`micro_batches`): the kept rows shortest first, a rank with none runs
    weightless fillers. The weights are 1 but for fillers (0), so the sum over micro-batches is
    the mini-batch's loss either way."""
    mbs = cfg.micro_batch_size
    if cfg.max_tokens is None:
        rows = rows_to_train(mini.attention_mask, skip, mbs)
        return [(rows[mb], 1.0) for mb in micro_batch_slices(len(rows), mbs)]
    kept = torch.arange(len(mini)) if skip is None else (~skip).nonzero().squeeze(-1).cpu()
    lengths = row_lengths(mini.attention_mask, mini.response_mask)
    if len(kept) == 0:  # nothing to train here: the shortest row, weightless, as often as needed
        shortest = min(range(len(lengths)), key=lambda i: (lengths[i], i))
        count = max_over_ranks(1)
        return [(torch.tensor([shortest]), 0.0)] * count
    kept = kept[torch.argsort(torch.tensor(lengths)[kept], stable=True)]
    micros = token_micro_batches([lengths[i] for i in kept.tolist()], cfg.max_tokens, mbs)
    return [(kept[m.rows], m.weight) for m in micros]


def by_length(attention_mask: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """Row order for a mini-batch: shortest sample first, so each micro-batch holds samples of
    similar length and `sequence_logprobs` trims its padding (a micro-batch costs as much as its
    longest sample). The gradient is the same sum over samples in any order; only its rounding
    differs. One micro-batch, or one row: the order is left alone."""
    n = attention_mask.shape[0]
    if n <= micro_batch_size:
        return torch.arange(n, device=attention_mask.device)
    return torch.argsort(attention_mask.sum(-1), stable=True)


def update_policy(
    model: PeftModel,
    optimizer: torch.optim.Optimizer,
    batch: TensorBatch,
    cfg: UpdateConfig,
    reference: dict[str, torch.Tensor] | None = None,
    *,
    params: list[torch.nn.Parameter] | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    replicas: int = 0,
) -> dict[str, float]:
    """`reference`: a frozen adapter (`snapshot_lora`) for the KL term; None: the base model.

    `params`: what the gradient clip covers (default: every trainable parameter; with a critic
    on the same model, the actor's only). `old_logprobs` / `ref_logprobs`: passes the caller
    already ran on this batch at the step's starting weights (PPO needs both before the update),
    so they are not run twice. `batch.token_advantages`, when set, replaces the per-sample ones.
    `replicas`: the step's engine count (`batch.replica_index`), for the per-engine mismatch.
    """
    token_level = cfg.loss.agg == "token-mean"
    if batch.token_advantages is not None:
        adv_tok = batch.token_advantages * batch.response_mask
    else:
        adv_tok = to_token_advantages(batch.advantages, batch.response_mask)
    on_policy = cfg.mini_batches == 1 and cfg.epochs == 1
    mbs = cfg.micro_batch_size
    old = None
    correcting = cfg.loss.correction != "off"
    old_is_rollout = cfg.behavior_from_rollout and not correcting
    if old_is_rollout:
        old = torch.where(batch.response_mask.bool(), batch.rollout_logprobs, 0.0)
    elif old_logprobs is not None:
        old = old_logprobs
    elif not on_policy:  # later mini-batches must see the policy the step started from
        with torch.no_grad():
            old, _ = sequence_logprobs(
                model, batch.input_ids, batch.attention_mask, batch.response_mask,
                micro_batch_size=mbs, temperature=cfg.temperature, max_tokens=cfg.max_tokens,
            )  # fmt: skip
    ref = None
    if cfg.loss.kl_coef > 0:
        ref = (
            ref_logprobs
            if ref_logprobs is not None
            else reference_pass(model, batch, cfg, reference)
        )
    clipped = params if params is not None else [p for p in model.parameters() if p.requires_grad]

    sums: dict[str, float] = defaultdict(float)  # token-weighted metric sums on this rank
    skip = gradient_free(batch, cfg)

    def denominator(mini: TensorBatch) -> float:
        # the loss is normalized by every sample of the mini-batch, trained or skipped
        g_tokens, g_seqs = all_reduce_sum(list(_counts(mini)))
        return max(g_tokens if token_level else g_seqs, 1.0)

    def plan(mini: TensorBatch, rows: slice) -> MicroPlan:
        return plan_micro_batches(mini, None if skip is None else skip[rows], cfg)

    def loss(micro: Micro) -> tuple[torch.Tensor, float]:
        sub, idx = micro.batch, micro.rows
        lp, ent = sequence_logprobs(
            model, sub.input_ids, sub.attention_mask, sub.response_mask,
            micro_batch_size=len(sub), with_entropy=True, temperature=cfg.temperature,
            entropy_grad=cfg.loss.entropy_coef > 0,  # else a metric: no graph
        )  # fmt: skip
        old_lp = lp.detach() if old is None else old[idx]
        value, metrics = rl_loss(
            lp, old_lp, adv_tok[idx], sub.response_mask, cfg.loss,
            ref_logprobs=None if ref is None else ref[idx], entropy=ent,
            rollout_logprobs=sub.rollout_logprobs,
        )  # fmt: skip
        tokens, seqs = _counts(sub)
        if micro.epoch == 0 and micro.weight:
            # Engine vs trainer at the same weights: the step's starting policy (later
            # mini-batches' `lp` has already moved), unless `old` is the engine's own.
            trainer_lp = lp if old is None or old_is_rollout else old_lp
            _accumulate(sums, metrics, trainer_lp, sub, tokens)
            if micro.first_mini:  # the policy has not moved yet: the ratio must be 1
                sums["first_tokens"] += tokens
                sums["first_clip"] += float(metrics["clip_frac"]) * tokens
        return value, tokens if token_level else seqs

    grad_norms = gradient_steps(
        model, optimizer, clipped, cfg.grad_clip, batch, Objective(denominator, plan, loss),
        mini_batches=cfg.mini_batches, epochs=cfg.epochs,
    )  # fmt: skip
    sums["batch_tokens"] = batch.response_mask.sum().item()  # skipped samples' tokens too
    return _finish(sums, grad_norms, replicas)


# |trainer - engine| logprob per token is histogrammed on fixed log-spaced edges (1e-9 .. 1e2, four
# per decade), so ranks sum counts with one all-reduce and quantiles need no gather.
MISMATCH_EDGES = tuple(10.0 ** (k / 4) for k in range(-36, 9))
MISMATCH_QUANTILES = (0.5, 0.9, 0.99)
_METRICS = ("policy_loss", "kl", "entropy", "clip_frac", "loss", "tis_clip_frac", "tis_weight_mean")


def _accumulate(sums, metrics, lp: torch.Tensor, sub: TensorBatch, tokens: float) -> None:
    mask = sub.response_mask.bool()
    sums["tokens"] += tokens
    gaps = (sub.rollout_logprobs - lp.detach()).abs()
    gap = gaps[mask]
    sums["mismatch"] += gap.sum().item()
    if sub.replicas is not None:  # per engine: its rows' gap and tokens
        row_gap = torch.where(mask, gaps, 0.0).sum(-1)
        row_tokens = mask.sum(-1)
        for k in sub.replicas.unique().tolist():
            if k >= 0:
                rows = sub.replicas == k
                sums[f"replica{k}_mismatch"] += row_gap[rows].sum().item()
                sums[f"replica{k}_tokens"] += row_tokens[rows].sum().item()
    edges = torch.tensor(MISMATCH_EDGES, dtype=gap.dtype, device=gap.device)
    counts = torch.bincount(torch.bucketize(gap, edges), minlength=len(MISMATCH_EDGES) + 1)
    for i, c in enumerate(counts.tolist()):
        sums[f"hist{i}"] += c
    for key in _METRICS:
        if key in metrics:
            sums[key] += float(metrics[key]) * tokens


def rollout_mismatch_metrics(
    batch: TensorBatch, trainer_logprobs: torch.Tensor, replicas: int = 0
) -> dict[str, float]:
    """The engine-vs-trainer metrics of a step whose policy did not move (PPO's critic warm-up):
    the same keys `update_policy` returns, with no update. Collective like it."""
    sums: dict[str, float] = defaultdict(float)
    _accumulate(sums, {}, trainer_logprobs, batch, batch.response_mask.sum().item())
    return _finish(sums, [], replicas)


def mismatch_quantiles(counts: list[float]) -> dict[str, float]:
    """Upper bin edge at each quantile; past the last edge (1e2): 1e3 (JSON has no inf)."""
    total = sum(counts)
    out: dict[str, float] = {}
    edges = (*MISMATCH_EDGES, MISMATCH_EDGES[-1] * 10)
    for q in MISMATCH_QUANTILES:
        acc, value = 0.0, edges[-1]
        for i, c in enumerate(counts):
            acc += c
            if acc >= q * total:
                value = edges[i]
                break
        out[f"logprob_mismatch_p{round(q * 100)}"] = value if total > 0 else 0.0
    return out


def _finish(sums: dict[str, float], grad_norms: list[float], replicas: int = 0) -> dict[str, float]:
    """The step's metrics, summed over ranks. `replicas`: how many engines the step's rows name
    (the same on every rank: `batch.replica_index` of the whole batch); their per-engine gap
    comes back as `replica_mismatch/<index>` (mean |engine - trainer| per token)."""
    hist = [f"hist{i}" for i in range(len(MISMATCH_EDGES) + 1)]
    per_replica = [f"replica{k}_{part}" for k in range(replicas) for part in ("mismatch", "tokens")]
    keys = ["tokens", "batch_tokens", "mismatch", "first_tokens", "first_clip"]
    keys += [*[k for k in _METRICS if k in sums], *hist, *per_replica]
    totals = dict(zip(keys, all_reduce_sum([sums.get(k, 0.0) for k in keys]), strict=True))
    counts = [totals.pop(k) for k in hist]
    by_replica = {}
    for k in range(replicas):
        gap, n = totals.pop(f"replica{k}_mismatch"), totals.pop(f"replica{k}_tokens")
        if n > 0:
            by_replica[f"replica_mismatch/{k}"] = gap / n
    first = totals.pop("first_clip") / max(totals.pop("first_tokens"), 1.0)
    batch_tokens = totals.pop("batch_tokens")
    tokens = max(totals.pop("tokens"), 1.0)
    out = {k: v / tokens for k, v in totals.items()}
    out["logprob_mismatch"] = out.pop("mismatch")
    out.update(mismatch_quantiles(counts))
    out["clip_frac_first_update"] = first
    out["grad_norm"] = grad_norms[-1] if grad_norms else 0.0
    out["trained_tokens"] = batch_tokens or tokens  # the batch's loss tokens, run or skipped
    out.update(by_replica)
    return out
