"""Micro-batches cut by a token budget per device (training.maxTokensPerMicroBatch; verl's
`use_dynamic_bsz` + `ppo_max_token_len_per_gpu`).

A micro-batch runs padded to its longest sample (`logprobs.used_width` trims the columns every row
leaves empty), so what it costs in activation memory is rows x longest: that is the budget's unit.
Rows are packed in the order given (the caller orders them shortest first, so each micro-batch
holds samples of similar length and the padding is small): a micro-batch takes the next row while
it stays within both the token budget and `micro_batch_size` rows. A sample longer than the
budget runs alone.

Under FSDP2 every forward is collective, so every rank must run the same number of micro-batches:
`balance` splits the largest micro-batches of a rank that has fewer (splitting never exceeds the
budget) and, when every one is a single row already, repeats the cheapest row as a weightless
filler (its loss is scaled by 0 and its logprobs are discarded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def row_lengths(attention_mask: torch.Tensor, response_mask: torch.Tensor) -> list[int]:
    """Per row: the columns up to its last attended or scored one (what `used_width` keeps)."""
    used = attention_mask.bool() | response_mask.bool()
    cols = torch.arange(1, used.shape[1] + 1, device=used.device)
    return (used * cols).amax(dim=1).clamp(min=1).tolist()


def pack_by_tokens(lengths: list[int], max_tokens: int, max_rows: int) -> list[list[int]]:
    """Positions 0..n-1 of `lengths`, cut in order into runs with rows x longest <= max_tokens
    and at most max_rows rows (a row over the budget alone). Pure and deterministic."""
    if max_tokens <= 0 or max_rows <= 0:
        raise ValueError(f"max_tokens and max_rows must be > 0, got {max_tokens}, {max_rows}")
    micros: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, length in enumerate(lengths):
        wider = max(longest, length)
        if current and (len(current) >= max_rows or (len(current) + 1) * wider > max_tokens):
            micros.append(current)
            current, wider = [], length
        current.append(i)
        longest = wider
    if current:
        micros.append(current)
    return micros


def micro_cost(micro: list[int], lengths: list[int]) -> int:
    return len(micro) * max(lengths[i] for i in micro)


@dataclass(frozen=True)
class MicroBatch:
    """Positions in the caller's row order; `weight` 0: a filler run only to match the other
    ranks' collectives."""

    rows: list[int]
    weight: float = 1.0


def balance(micros: list[list[int]], count: int, lengths: list[int]) -> list[MicroBatch]:
    """Exactly `count` micro-batches (count >= len(micros), and >= 1): split the costliest
    multi-row micro-batch in two (in order, first one earliest on ties) until there are enough;
    then weightless repeats of the cheapest row. Pure."""
    if count < len(micros) or count < 1:
        raise ValueError(f"cannot make {count} micro-batches out of {len(micros)}")
    if not lengths:
        raise ValueError("no rows to make micro-batches of")
    micros = [list(m) for m in micros]
    while len(micros) < count:
        splittable = [k for k, m in enumerate(micros) if len(m) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda j: (micro_cost(micros[j], lengths), -j))
        m = micros[k]
        half = (len(m) + 1) // 2
        micros[k : k + 1] = [m[:half], m[half:]]
    out = [MicroBatch(m) for m in micros]
    cheapest = min(range(len(lengths)), key=lambda i: (lengths[i], i))
    out += [MicroBatch([cheapest], 0.0)] * (count - len(out))
    return out


def max_over_ranks(n: int) -> int:
    """The largest `n` over the ranks (a collective under torch.distributed)."""
    t = torch.tensor([n], dtype=torch.long)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def token_micro_batches(
    lengths: list[int], max_tokens: int, max_rows: int, *, at_least: int = 1
) -> list[MicroBatch]:
    """This rank's micro-batches over `lengths` (in the given order), as many as the rank that
    needs the most (collective: every rank calls it once per pass)."""
    micros = pack_by_tokens(lengths, max_tokens, max_rows) if lengths else []
    count = max_over_ranks(max(len(micros), at_least))
    return balance(micros, count, lengths)
