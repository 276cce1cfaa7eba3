"""Per-token log-probabilities (and entropy) of given sequences under the policy or the reference.

Output is aligned with `input_ids`: position t holds log p(x_t | x_<t), so response masks built
over token positions apply directly; position 0 (no prefix) is always 0.

Under FSDP2 every forward is collective: all ranks must call these with the same number of
micro-batches (equal batch sizes per rank).
"""

from __future__ import annotations

import torch
from peft import PeftModel
from torch import nn


def _check_shapes(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    micro_batch_size: int,
) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}")
    for name, t in (("attention_mask", attention_mask), ("response_mask", response_mask)):
        if t.shape != input_ids.shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
            )
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding, so left-padded rows score like unpadded ones."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shifted gather of log-softmax in fp32; returns [B, T] with a zero column at t=0."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    zero = picked.new_zeros(picked.shape[0], 1)
    out = torch.cat([zero, picked], dim=1)
    if not with_entropy:
        return out, None
    entropy = -(logp.exp() * logp).sum(-1)
    return out, torch.cat([zero, entropy], dim=1)


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    micro_batch_size: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [B, T] (fp32, zero outside `response_mask`) and optionally entropy [B, T].

    Keeps the autograd graph when grad is enabled, so the caller can backprop a loss on them.
    """
    _check_shapes(input_ids, attention_mask, response_mask, micro_batch_size)
    lps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    for start in range(0, input_ids.shape[0], micro_batch_size):
        sl = slice(start, start + micro_batch_size)
        ids, am = input_ids[sl], attention_mask[sl]
        out = model(
            input_ids=ids,
            attention_mask=am,
            position_ids=position_ids_from_mask(am),
            use_cache=False,
        )
        lp, ent = token_logprobs_from_logits(out.logits, ids, with_entropy)
        keep = response_mask[sl].bool()  # where(), not multiply: 0 * -inf would be NaN
        lps.append(torch.where(keep, lp, 0.0))
        if ent is not None:
            ents.append(torch.where(keep, ent, 0.0))
    logprobs = torch.cat(lps)
    return logprobs, (torch.cat(ents) if with_entropy else None)


def reference_logprobs(
    peft_model: PeftModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    micro_batch_size: int,
) -> torch.Tensor:
    """Logprobs under the frozen base: the same model with the adapter disabled, no second copy.

    `disable_adapter()` toggles `requires_grad` on LoRA parameters and re-enables them on exit;
    the flags are restored explicitly afterwards so a wrapper that re-registers parameters
    (FSDP) can never leave the policy frozen.
    """
    flags = {name: p.requires_grad for name, p in peft_model.named_parameters()}
    try:
        with torch.no_grad(), peft_model.disable_adapter():
            logprobs, _ = sequence_logprobs(
                peft_model,
                input_ids,
                attention_mask,
                response_mask,
                micro_batch_size=micro_batch_size,
                with_entropy=False,
            )
    finally:
        for name, p in peft_model.named_parameters():
            if p.requires_grad != flags.get(name, p.requires_grad):
                p.requires_grad_(flags[name])
    return logprobs
