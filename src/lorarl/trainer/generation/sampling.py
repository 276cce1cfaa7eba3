"""The job spec's sampling settings as engine-neutral `SamplingParams`, for training and eval.

One place for the mapping so every spec field provably reaches the engines' requests (the
request builders in engines_wire send whatever is set here).
"""

from __future__ import annotations

import dataclasses

from lorarl.api.spec.job import LoRARLJobSpec
from lorarl.trainer.generation.types import SamplingParams


def train_sampling(spec: LoRARLJobSpec, eos_token_id: int | None) -> SamplingParams:
    """rollout.sampling, completions capped at data.maxResponseTokens, seeded by training.seed."""
    s = spec.rollout.sampling
    return SamplingParams(
        max_tokens=spec.data.max_response_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=None if s.top_k in (-1, 0) else s.top_k,
        seed=spec.training.seed,
        stop_token_ids=(eos_token_id,) if eos_token_id is not None else (),
        stop=tuple(s.stop),
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
    )


def eval_sampling(spec: LoRARLJobSpec, train: SamplingParams) -> SamplingParams:
    """training.eval's settings over the train sampling: the seed and the stop tokens and strings
    (they belong to the task's format) carry over; length defaults to data.maxResponseTokens."""
    e = spec.training.eval
    return dataclasses.replace(
        train,
        temperature=e.temperature,
        top_p=e.top_p,
        top_k=None,
        min_p=e.min_p,
        repetition_penalty=e.repetition_penalty,
        max_tokens=e.max_tokens or spec.data.max_response_tokens,
    )


SEED_SPACE = 2**31  # round seeds stay below it; a request's own offsets go on top (< 2**32)


def round_seed(seed: int, step: int, round_: int, *, streams: int, rounds: int) -> int:
    """The first seed of one generation round's block of `streams` consecutive seeds.

    A round (one batch of prompts: a step, or one DAPO refill of it) draws at most `streams`
    random streams: prompts x samples per prompt (x turns per episode). Rounds get disjoint
    blocks in (step, round) order, `rounds` blocks per step, so no stream is drawn twice in a
    job until 2**31 of them have been used; the job seed picks where the sequence starts.
    """
    if streams < 1 or rounds < 1 or not 0 <= round_ < rounds:
        raise ValueError(f"bad seed block: round {round_} of {rounds}, {streams} streams")
    block = (step * rounds + round_) * streams
    return (seed * 1_000_003 + block) % SEED_SPACE
