"""Per-token log-probabilities (and entropy) of given sequences under the policy or the reference.

Output is aligned with `input_ids`: position t holds log p(x_t | x_<t), so response masks built
over token positions apply directly; position 0 (no prefix) is always 0.

Under FSDP2 every forward is collective: all ranks must call these with the same number of
micro-batches (equal batch sizes per rank).
"""

from __future__ import annotations

import inspect
from typing import TypedDict, Unpack

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import nn
from torch.distributed.tensor import DTensor

from lorarl.trainer.model.loading import lora_parameters
from lorarl.trainer.model.micro_batches import row_lengths, token_micro_batches
from lorarl.trainer.model.precision import lora_compute
from lorarl.trainer.rl.losses import chunked_logprobs, entropy_from_logits


def check_shapes(
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


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


# Rows (positions) of logits upcast to fp32 at a time in the logprob and entropy passes.
CHUNK_ROWS = 256


def token_logprobs_from_logits(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    with_entropy: bool,
    first: int = 1,
    temperature: float = 1.0,
    *,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shifted gather of log-softmax(logits / temperature) in fp32; [B, T], zero before `first`.

    `logits` hold positions `first - 1 .. T - 1` (all of them when `first` is 1): the logits at
    t - 1 score token t, so the last position is never used. The temperature is the sampling
    one: the engines sample from softmax(z / T), so that is the policy being scored (verl, TRL).

    Computed `CHUNK_ROWS` positions at a time (`losses.chunked_logprobs`): no full-vocabulary
    fp32 log-softmax is materialised, with grad or without. The entropy is a detached metric
    unless `entropy_grad` (an entropy term in the loss), which builds its graph.
    """
    _check_temperature(temperature)
    if not 1 <= first <= input_ids.shape[1]:
        raise ValueError(f"first must be in [1, {input_ids.shape[1]}], got {first}")
    expected = input_ids.shape[1] - first + 1
    if logits.shape[1] != expected:
        raise ValueError(f"logits cover {logits.shape[1]} positions, expected {expected}")
    # The last position scores nothing: label -1 (logprob 0) rather than a slice of the logits,
    # whose gradient autograd would build as a second logits-sized tensor.
    labels = F.pad(input_ids[:, first:], (0, 1), value=-1)
    picked, entropy = chunked_logprobs(
        logits, labels, temperature=temperature, chunk_rows=CHUNK_ROWS,
        with_entropy=with_entropy and not entropy_grad,
    )  # fmt: skip
    picked = picked[:, :-1]
    if with_entropy and entropy_grad:
        entropy = entropy_from_logits(logits, chunk_rows=CHUNK_ROWS, temperature=temperature)
    if entropy is not None:
        entropy = entropy[:, :-1]
    zeros = picked.new_zeros(picked.shape[0], first)
    out = torch.cat([zeros, picked], dim=1)
    if not with_entropy or entropy is None:
        return out, None
    return out, torch.cat([zeros, entropy], dim=1)


def first_scored_position(response_mask: torch.Tensor) -> int:
    """The earliest column any row scores (at least 1: token 0 has no prefix to score it)."""
    columns = response_mask.bool().any(dim=0).nonzero()
    first = int(columns[0]) if len(columns) else response_mask.shape[1]
    return max(first, 1)


def used_width(attention_mask: torch.Tensor, response_mask: torch.Tensor) -> int:
    """Columns up to the last one any row attends to or scores (at least 1).

    A batch is padded to its longest sample, so a micro-batch of shorter ones ends in columns
    that are padding in every row. A causal model's outputs at a position never depend on later
    ones, so cutting those columns off changes no logprob and saves their compute (the update
    sorts samples by length so each micro-batch is as short as it can be).
    """
    used = (attention_mask.bool() | response_mask.bool()).any(dim=0).nonzero()
    return int(used[-1]) + 1 if len(used) else 1


def _takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether the model computes the LM head only for the last N positions when asked."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    micro_batch_size: int,
    with_entropy: bool = False,
    temperature: float = 1.0,
    entropy_grad: bool = False,
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [B, T] (fp32, zero outside `response_mask`) and optionally entropy [B, T], of
    the distribution sampled at `temperature`. The entropy is detached (a metric) unless
    `entropy_grad` (an entropy bonus in the loss).

    Keeps the autograd graph when grad is enabled, so the caller can backprop a loss on them.
    The LM head and log-softmax run only from the micro-batch's first completion position on:
    with a vocabulary of 50k-150k they cost as much as the decoder, and prompt logits are unused.

    `max_tokens` (training.maxTokensPerMicroBatch): micro-batches hold at most that many tokens
    (rows x longest) as well as at most `micro_batch_size` rows (`micro_batches`).
    """
    check_shapes(input_ids, attention_mask, response_mask, micro_batch_size)
    _check_temperature(temperature)
    head_on_demand = _takes_logits_to_keep(model)
    kw = _PassOptions(with_entropy=with_entropy, temperature=temperature, entropy_grad=entropy_grad)
    if max_tokens is not None:
        return _token_budget_logprobs(
            model, input_ids, attention_mask, response_mask, micro_batch_size, max_tokens,
            head_on_demand, **kw,
        )  # fmt: skip
    lps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    for start in range(0, input_ids.shape[0], micro_batch_size):
        sl = slice(start, start + micro_batch_size)
        lp, ent = _micro_pass(
            model, input_ids[sl], attention_mask[sl], response_mask[sl], head_on_demand, **kw
        )
        lps.append(lp)
        if ent is not None:
            ents.append(ent)
    logprobs = torch.cat(lps)
    return logprobs, (torch.cat(ents) if with_entropy else None)


class _PassOptions(TypedDict):
    """What `sequence_logprobs` passes on to each micro-batch pass."""

    with_entropy: bool
    temperature: float
    entropy_grad: bool


def _micro_pass(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    head_on_demand: bool,
    *,
    with_entropy: bool,
    temperature: float,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward over a micro-batch; [b, T] logprobs (and entropy), zero outside the mask."""
    full_width = input_ids.shape[1]
    width = used_width(attention_mask, response_mask)
    ids, am = input_ids[:, :width], attention_mask[:, :width]
    resp = response_mask[:, :width]
    first = first_scored_position(resp)
    extra = {"logits_to_keep": ids.shape[1] - first + 1} if head_on_demand else {}
    with lora_compute(model):  # bf16 LoRA compute on CPU when the base is bf16
        out = model(
            input_ids=ids,
            attention_mask=am,
            position_ids=position_ids_from_mask(am),
            use_cache=False,
            **extra,
        )
    logits = out.logits if head_on_demand else out.logits[:, first - 1 :]
    lp, ent = token_logprobs_from_logits(
        logits, ids, with_entropy, first, temperature, entropy_grad=entropy_grad
    )
    keep = resp.bool()  # where(), not multiply: 0 * -inf would be NaN
    pad = (0, full_width - width)  # back to the batch's width: zeros on the trimmed columns
    lp = F.pad(torch.where(keep, lp, 0.0), pad)
    if ent is not None:
        ent = F.pad(torch.where(keep, ent, 0.0), pad)
    return lp, ent


def _token_budget_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    micro_batch_size: int,
    max_tokens: int,
    head_on_demand: bool,
    **kw: Unpack[_PassOptions],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sequence_logprobs` in micro-batches cut by a token budget (`micro_batches`): rows run
    shortest first, results go back to their rows; fillers' results are dropped. Collective."""
    lengths = row_lengths(attention_mask, response_mask)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])  # stable: ties keep order
    micros = token_micro_batches([lengths[i] for i in order], max_tokens, micro_batch_size)
    lp_parts: list[torch.Tensor] = []
    ent_parts: list[torch.Tensor] = []
    rows_done: list[int] = []
    for micro in micros:
        idx = torch.tensor([order[p] for p in micro.rows], device=input_ids.device)
        lp, ent = _micro_pass(
            model, input_ids[idx], attention_mask[idx], response_mask[idx], head_on_demand, **kw
        )
        if micro.weight == 0:
            continue
        rows_done += idx.tolist()
        lp_parts.append(lp)
        if ent is not None:
            ent_parts.append(ent)
    # cat then one gather back to the caller's row order: differentiable, unlike index_put
    back = torch.argsort(torch.tensor(rows_done, device=input_ids.device))
    logprobs = torch.cat(lp_parts)[back]
    return logprobs, (torch.cat(ent_parts)[back] if ent_parts else None)


def reference_logprobs(
    peft_model: PeftModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Logprobs under the frozen base: the same model with the adapter disabled, no second copy.
    Scored at the sampling temperature like the policy (as verl does), so the KL compares the
    same two distributions the samples are judged by.

    `disable_adapter()` disables every adapter (actor and critic) and on exit re-enables only
    the active one's `requires_grad`: the flags of all parameters are restored explicitly
    afterwards, so neither the critic nor (under FSDP, which re-registers parameters) the
    policy is left frozen.
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
                temperature=temperature,
                max_tokens=max_tokens,
            )
    finally:
        for name, p in peft_model.named_parameters():
            if p.requires_grad != flags.get(name, p.requires_grad):
                p.requires_grad_(flags[name])
    return logprobs


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def snapshot_lora(peft_model: PeftModel) -> dict[str, torch.Tensor]:
    """This rank's actor LoRA tensors (local shards under FSDP2), copied: the frozen initial adapter
    for `kl.reference: initialAdapter` costs one copy of the adapter, not of the model."""
    return {n: _local(p).detach().clone() for n, p in lora_parameters(peft_model)}


def adapter_reference_logprobs(
    peft_model: PeftModel,
    reference: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Logprobs under a frozen adapter (`snapshot_lora`) on the same base: its tensors are swapped
    into the LoRA parameters for one no-grad pass and the policy's are put back, even on error.
    Collective under FSDP2 like every forward."""
    params = dict(lora_parameters(peft_model))
    if set(params) != set(reference):
        raise ValueError("the reference adapter does not match the model's LoRA parameters")
    current = snapshot_lora(peft_model)
    try:
        with torch.no_grad():
            for n, p in params.items():
                _local(p).copy_(reference[n])
            logprobs, _ = sequence_logprobs(
                peft_model, input_ids, attention_mask, response_mask,
                micro_batch_size=micro_batch_size, temperature=temperature,
                max_tokens=max_tokens,
            )  # fmt: skip
    finally:
        with torch.no_grad():
            for n, p in params.items():
                _local(p).copy_(current[n])
    return logprobs
