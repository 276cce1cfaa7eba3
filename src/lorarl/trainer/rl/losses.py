"""Policy-gradient losses on token tensors ``[B, T]`` with a response mask.

Metrics come back as detached 0-dim tensors, not Python floats: calling ``.item()`` here would
force a device sync per micro-batch; the trainer converts them once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "AGG_MODES",
    "CORRECTION_MODES",
    "KL_ESTIMATORS",
    "LossConfig",
    "aggregate",
    "chunked_logprobs",
    "entropy_from_logits",
    "kl_penalty",
    "policy_loss",
    "rl_loss",
    "rollout_correction",
    "token_logprobs_from_logits",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# verl's names: low_var_kl is k3, mse is k2.
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "mse")
CORRECTION_MODES = ("tis", "mask-token", "mask-sequence", "off")
_SUM_MODES = ("seq-mean-token-sum", "seq-mean-token-sum-norm")
_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: far past any clip range, still finite in fp32


def _check_same_shape(ref: Tensor, **others: Tensor) -> None:
    if ref.dim() != 2:
        raise ValueError(f"expected 2-D [batch, tokens] tensors, got shape {tuple(ref.shape)}")
    for name, t in others.items():
        if t.shape != ref.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match {tuple(ref.shape)}")


def aggregate(
    loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", *, norm_len: int | None = None
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar over the unmasked tokens.

    - ``token-mean``: every token weighs the same (DAPO); long answers are not diluted.
    - ``seq-mean-token-mean``: every sequence weighs the same (GRPO paper).
    - ``seq-mean-token-sum``: per-sequence sums, mean over sequences. With ``norm_len`` sums are
      divided by it.
    - ``seq-mean-token-sum-norm`` (verl's name; Dr.GRPO): per-sequence sums divided by the
      constant ``norm_len`` (required; the max response length), mean over sequences: no length
      bias, and the loss scale does not grow with response length (so gradClip stays meaningful).
    Sequence modes average over sequences that have at least one token, so all-padding rows
    (micro-batch filler) do not shrink the loss. No tokens at all gives 0, still in the graph.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    _check_same_shape(loss_mat, mask=mask)
    if norm_len is not None and (mode not in _SUM_MODES or norm_len <= 0):
        raise ValueError(
            f"norm_len applies to 'seq-mean-token-sum' only and must be > 0; "
            f"got norm_len={norm_len} with mode {mode!r}"
        )
    if mode == "seq-mean-token-sum-norm" and norm_len is None:
        raise ValueError("'seq-mean-token-sum-norm' needs norm_len (e.g. the max response length)")
    m = mask.to(loss_mat.dtype)
    masked = loss_mat * m
    if mode == "token-mean":
        return masked.sum() / m.sum().clamp(min=1.0)
    tokens_per_seq = m.sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / tokens_per_seq.clamp(min=1.0)
    else:
        per_seq = masked.sum(dim=1) / (float(norm_len) if norm_len is not None else 1.0)
    n_seqs = (tokens_per_seq > 0).to(loss_mat.dtype).sum()
    return per_seq.sum() / n_seqs.clamp(min=1.0)


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    return ((x * m).sum() / m.sum().clamp(min=1.0)).detach()


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages_tok: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_len: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, ratio clipped to ``[1 - clip_low, 1 + clip_high]``.

    Separate bounds are DAPO's clip-higher: a larger ``clip_high`` lets unlikely tokens with
    positive advantage grow, which keeps entropy from collapsing. ``dual_clip`` (c > 1) caps the
    loss of negative-advantage tokens at ``-A * c``, so a token whose ratio exploded cannot
    dominate. ``is_weights`` (detached, from ``rollout_correction``) multiply the per-token loss
    after clipping, as verl's rollout IS and TRL's vLLM IS correction do.
    ``clip_frac`` counts tokens whose gradient the clipping removed.
    """
    _check_same_shape(logprobs, old_logprobs=old_logprobs, advantages_tok=advantages_tok, mask=mask)
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    adv = advantages_tok.detach().to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    ppo_clip_active = clipped > unclipped
    loss_mat = torch.where(ppo_clip_active, clipped, unclipped)
    dual_active = torch.zeros_like(ppo_clip_active)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_active = (adv < 0) & (loss_mat > cap)
        loss_mat = torch.where(dual_active, cap, loss_mat)
    if is_weights is not None:
        _check_same_shape(logprobs, is_weights=is_weights)
        loss_mat = loss_mat * is_weights.detach().to(loss_mat.dtype)
    loss = aggregate(loss_mat, mask, agg, norm_len=norm_len)
    m = mask.to(logprobs.dtype)
    metrics = {
        "clip_frac": _masked_mean((ppo_clip_active | dual_active).to(m.dtype), m),
        "dual_clip_frac": _masked_mean(dual_active.to(m.dtype), m),
        "approx_kl": _masked_mean(old_logprobs - logprobs, m),
        "ratio_mean": _masked_mean(ratio, m),
    }
    return loss, metrics


def rollout_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    mode: str = "tis",
    threshold: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights correcting for the engine not sampling from the trainer's policy.

    ``rho = pi_old / pi_engine`` per token (trainer logprob vs the engine's reported one): the
    engine computes in another precision, with other kernels, or with older weights.
    - ``tis``: truncated importance sampling, ``w = min(rho, threshold)`` (verl's rollout IS,
      TRL's vLLM IS correction with cap 2).
    - ``mask-token``: ``w = 1`` where ``1/threshold <= rho <= threshold``, else 0.
    - ``mask-sequence``: a sequence is kept (``w = 1``) only if its geometric-mean ratio
      ``exp(mean_t log rho)`` is within ``[1/threshold, threshold]``.
    - ``off``: ``w = 1``.
    Masked tokens keep their place in the loss denominator (weight 0), as TRL's masking does.
    ``tis_clip_frac`` is the fraction of tokens whose weight was truncated or zeroed.
    """
    _check_same_shape(old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    if mode not in CORRECTION_MODES:
        raise ValueError(f"unknown correction {mode!r}; valid: {', '.join(CORRECTION_MODES)}")
    if not threshold > 1.0:
        raise ValueError(f"threshold must be > 1, got {threshold}")
    m = mask.to(old_logprobs.dtype)
    log_rho = ((old_logprobs - rollout_logprobs) * m).detach()
    log_rho = log_rho.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    rho = torch.exp(log_rho)
    log_c = math.log(threshold)
    if mode == "tis":
        weights = rho.clamp(max=threshold)
        hit = rho > threshold
    elif mode == "mask-token":
        hit = log_rho.abs() > log_c
        weights = (~hit).to(rho.dtype)
    elif mode == "mask-sequence":
        seq = log_rho.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        hit = (seq.abs() > log_c).unsqueeze(1).expand_as(rho)
        weights = (~hit).to(rho.dtype)
    else:
        weights = torch.ones_like(rho)
        hit = torch.zeros_like(rho, dtype=torch.bool)
    weights = weights * m
    metrics = {
        "tis_clip_frac": _masked_mean(hit.to(m.dtype), m),
        "tis_weight_mean": _masked_mean(weights, m),
    }
    return weights, metrics


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token logprobs.

    ``k1`` is an unbiased estimate of the KL *value* but, used as a loss, its gradient is zero
    in expectation (E_pi[grad log pi] = 0): it does not pull the policy toward the reference.
    ``k2`` / ``mse`` (``0.5 * d^2``) is the one whose gradient as a loss equals the gradient of
    KL(pi || ref) in expectation (on-policy samples). ``k3`` / ``low_var_kl``
    (``exp(d) - d - 1`` with ``d = ref - logp``) is a non-negative low-variance value estimate
    whose loss gradient is that of KL(ref || pi) instead; clamped to [-10, 10] as in verl.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; valid estimators: {', '.join(KL_ESTIMATORS)}"
        )
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs shape {tuple(ref_logprobs.shape)} does not match "
            f"logprobs shape {tuple(logprobs.shape)}"
        )
    diff = logprobs - ref_logprobs.detach()
    if estimator == "k1":
        return diff
    if estimator in ("k2", "mse"):
        return 0.5 * diff.square()
    d = (-diff).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)


def _check_logits_labels(logits: Tensor, labels: Tensor) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be 3-D [batch, tokens, vocab], got {tuple(logits.shape)}")
    if labels.shape != logits.shape[:2]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape[:2])}"
        )
    if labels.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"labels must be integer token ids, got dtype {labels.dtype}")
    if bool((labels >= logits.shape[-1]).any()):
        raise ValueError(f"labels contain ids >= vocab size {logits.shape[-1]}")


def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    z = chunk.float()
    return z / temperature if temperature != 1.0 else z


def _chunks(batch: int, tokens: int, chunk_rows: int) -> list[tuple[slice, slice]]:
    """(rows, positions) index pairs covering ``[batch, tokens]`` in pieces of at most
    ``chunk_rows`` positions: whole rows together when they are short, else parts of one row."""
    if tokens == 0 or batch == 0:
        return []
    if tokens <= chunk_rows:
        step = chunk_rows // tokens
        return [(slice(b, b + step), slice(None)) for b in range(0, batch, step)]
    return [
        (slice(b, b + 1), slice(t, t + chunk_rows))
        for b in range(batch)
        for t in range(0, tokens, chunk_rows)
    ]


class _ChunkedLogprob(torch.autograd.Function):
    """``log softmax(z / T)[label]`` per position of ``[B, T, V]`` logits, a chunk of positions
    at a time, and optionally the (non-differentiable) entropy of each position's distribution.

    Autograd keeps only the logits it was given (no copy: a slice of the model's output stays a
    view) and one logsumexp per position; the backward recomputes ``softmax`` a chunk at a time.
    Neither pass holds a full-vocabulary fp32 tensor for more than ``chunk_rows`` positions,
    where ``log_softmax`` under autograd keeps a ``[B, T, V]`` fp32 output until the backward.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_rows, with_entropy):
        b, t = logits.shape[:2]
        out = torch.empty(b, t, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        ent = torch.empty_like(out) if with_entropy else out.new_empty(0)
        safe = labels.clamp(min=0).unsqueeze(-1)
        for rows, cols in _chunks(b, t, chunk_rows):
            z = _scaled(logits[rows, cols], temperature)
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[rows, cols] = chunk_lse
            out[rows, cols] = z.gather(-1, safe[rows, cols]).squeeze(-1) - chunk_lse
            if with_entropy:
                p = torch.exp(z - chunk_lse.unsqueeze(-1))
                # H = lse - sum p z; a -inf logit has p = 0 and its 0 * -inf (NaN) counts 0
                ent[rows, cols] = chunk_lse - torch.nansum(p.mul_(z), dim=-1)
        out.masked_fill_(labels < 0, 0.0)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, _grad_ent):
        logits, labels, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        g = grad_out.float().masked_fill(labels < 0, 0.0).unsqueeze(-1)
        safe = labels.clamp(min=0).unsqueeze(-1)
        for rows, cols in _chunks(*labels.shape, ctx.chunk_rows):
            p = torch.exp(_scaled(logits[rows, cols], temperature) - lse[rows, cols].unsqueeze(-1))
            gc = g[rows, cols]
            d = (-p * gc).scatter_add_(-1, safe[rows, cols], gc)  # g * (onehot - p)
            if temperature != 1.0:
                d = d / temperature
            grad[rows, cols] = d.to(grad.dtype)
        return grad, None, None, None, None


def chunked_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = 4096,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``(log p(label), entropy or None)`` per position of ``softmax(logits / temperature)``,
    ``[B, T, V] x [B, T] -> [B, T]`` in fp32, differentiable in the logprobs only.

    The memory-lean path of the update: see `_ChunkedLogprob`. The entropy is a metric here
    (no graph); an entropy *loss* needs `entropy_from_logits`. Negative labels give 0.
    """
    _check_logits_labels(logits, labels)
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be > 0, got {chunk_rows}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lp, ent = _ChunkedLogprob.apply(
        logits, labels.long(), float(temperature), chunk_rows, with_entropy
    )
    return lp, (ent if with_entropy else None)


def token_logprobs_from_logits(logits: Tensor, labels: Tensor, *, chunk_rows: int = 4096) -> Tensor:
    """``log p(label)`` per position, ``[B, T, V] x [B, T] -> [B, T]`` in fp32.

    Computed as ``logit[label] - logsumexp(logits)`` on row chunks: no log_softmax is ever
    materialized, and at most one chunk is upcast at a time, with or without grad
    (`chunked_logprobs`). The caller aligns labels with logits (no shift here). Negative labels
    (ignore index, padding) give 0.
    """
    return chunked_logprobs(logits, labels, chunk_rows=chunk_rows)[0]


def entropy_from_logits(
    logits: Tensor, *, chunk_rows: int = 4096, temperature: float = 1.0
) -> Tensor:
    """Entropy of the next-token distribution ``softmax(logits / temperature)`` per position,
    ``[B, T, V] -> [B, T]`` in fp32, differentiable (the entropy bonus).

    ``H = -sum p log p`` with ``log p = logits - logsumexp``; ``-inf`` logits (masked vocabulary)
    contribute 0 instead of ``0 * -inf = NaN``, in the value and in the gradient.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be 3-D [batch, tokens, vocab], got {tuple(logits.shape)}")
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be > 0, got {chunk_rows}")
    batch, tokens = logits.shape[:2]
    if batch == 0 or tokens == 0:
        return logits.new_zeros((batch, tokens), dtype=torch.float32)

    def entropy(z: Tensor) -> Tensor:
        logp = torch.log_softmax(_scaled(z, temperature), dim=-1)
        p = logp.exp()
        return -(p * logp.masked_fill(p == 0, 0.0)).sum(dim=-1)

    if tokens <= chunk_rows:  # whole rows per chunk, as `_chunks`
        step = chunk_rows // tokens
        return torch.cat([entropy(logits[b : b + step]) for b in range(0, batch, step)])
    return torch.stack([
        torch.cat([entropy(logits[b, t : t + chunk_rows]) for t in range(0, tokens, chunk_rows)])
        for b in range(batch)
    ])  # fmt: skip


@dataclass(frozen=True)
class LossConfig:
    """The loss half of ``spec.algorithm``; validated once so each step need not re-check."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: str = "token-mean"
    norm_len: int | None = None
    correction: str = "off"
    correction_threshold: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "low_var_kl"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.agg not in AGG_MODES:
            raise ValueError(f"agg must be one of {', '.join(AGG_MODES)}; got {self.agg!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {self.kl_estimator!r}"
            )
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.norm_len is not None and (self.agg not in _SUM_MODES or self.norm_len <= 0):
            raise ValueError(
                f"norm_len applies to agg 'seq-mean-token-sum' only and must be > 0; "
                f"got norm_len={self.norm_len} with agg {self.agg!r}"
            )
        if self.agg == "seq-mean-token-sum-norm" and self.norm_len is None:
            raise ValueError("agg 'seq-mean-token-sum-norm' needs norm_len")
        if self.correction not in CORRECTION_MODES:
            raise ValueError(
                f"correction must be one of {', '.join(CORRECTION_MODES)}; got {self.correction!r}"
            )
        if not self.correction_threshold > 1.0:
            raise ValueError(f"correction_threshold must be > 1, got {self.correction_threshold}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")


def rl_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages_tok: Tensor,
    mask: Tensor,
    config: LossConfig | None = None,
    *,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``policy + kl_coef * agg(kl) - entropy_coef * agg(entropy)`` with its parts as metrics.

    KL and entropy are reported whenever given, even with a zero coefficient, so a run without
    the penalty still shows how far it drifted. With ``rollout_logprobs`` (the engine's) and a
    correction other than ``off``, the policy term is weighted by ``rollout_correction``.
    """
    cfg = config or LossConfig()
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy")
    weights: Tensor | None = None
    correction: dict[str, Tensor] = {}
    if cfg.correction != "off":
        if rollout_logprobs is None:
            raise ValueError(f"correction {cfg.correction!r} needs rollout_logprobs")
        weights, correction = rollout_correction(
            old_logprobs, rollout_logprobs, mask, cfg.correction, cfg.correction_threshold
        )
    pg, metrics = policy_loss(
        logprobs,
        old_logprobs,
        advantages_tok,
        mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
        agg=cfg.agg,
        norm_len=cfg.norm_len,
        is_weights=weights,
    )
    metrics.update(correction)
    total = pg
    metrics["policy_loss"] = pg.detach()
    if ref_logprobs is not None:
        kl = aggregate(
            kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator),
            mask,
            cfg.agg,
            norm_len=cfg.norm_len,
        )
        metrics["kl"] = kl.detach()
        if cfg.kl_coef > 0:
            total = total + cfg.kl_coef * kl
    if entropy is not None:
        _check_same_shape(logprobs, entropy=entropy)
        ent = aggregate(entropy, mask, cfg.agg, norm_len=cfg.norm_len)
        metrics["entropy"] = ent.detach()
        if cfg.entropy_coef > 0:
            total = total - cfg.entropy_coef * ent
    metrics["loss"] = total.detach()
    return total, metrics
