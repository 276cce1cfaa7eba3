"""Rollout samples -> padded training tensors (pure)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from lorarl.trainer.rl.samples import TrainSample


@dataclass
class TensorBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    response_mask: torch.Tensor  # [B, T], 1 on completion tokens
    rollout_logprobs: torch.Tensor  # [B, T], aligned with response_mask
    advantages: torch.Tensor  # [B]
    rewards: torch.Tensor | None = None  # [B], the samples' scores (PPO's token rewards)
    # [B, T]: per-token advantages (PPO's GAE); None: `advantages` broadcast over the tokens.
    token_advantages: torch.Tensor | None = None
    # [B, T]: per-turn rewards on the turns' last tokens (ppo, environment.turnRewards)
    turn_rewards: torch.Tensor | None = None
    # [B]: each row's engine, an index into the step's sorted endpoints (`replica_index`); -1:
    # none (a filler). None: not tracked.
    replicas: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TensorBatch:
        """`fn` applied to every tensor; absent ones stay None."""
        out = copy.copy(self)
        for f in fields(self):
            tensor = getattr(self, f.name)
            if tensor is not None:
                setattr(out, f.name, fn(tensor))
        return out

    def to(self, device: torch.device | str) -> TensorBatch:
        """Every tensor on `device`, the model's: on GPU the logprob gather, the loss and the
        mismatch histogram combine the batch with the logits, so both must live there."""
        return self._map(lambda t: t.to(device))

    def take(self, rows: torch.Tensor) -> TensorBatch:
        """The samples at `rows` (an index tensor), in that order."""
        return self._map(lambda t: t[rows])

    def slice(self, sl: slice) -> TensorBatch:
        return self._map(lambda t: t[sl])


def replica_index(samples: list[TrainSample]) -> list[str]:
    """The step's engines in a fixed order: computed from the whole batch (before sharding), so
    every rank numbers them alike."""
    return sorted({s.endpoint for s in samples if s.endpoint})


def collate(
    samples: list[TrainSample],
    pad_id: int,
    device: torch.device | str | None = None,
    endpoints: list[str] | None = None,
) -> TensorBatch:
    """Right-pad prompt+completion; position t of the masks marks completion token t. Built on
    the host, then moved to `device` (the trainer's) in one copy per tensor. `endpoints`
    (`replica_index` of the whole step) numbers each row's engine in `replicas`."""
    if not samples:
        raise ValueError("cannot collate an empty batch")
    length = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    n = len(samples)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    attn = torch.zeros((n, length), dtype=torch.long)
    resp = torch.zeros((n, length), dtype=torch.float32)
    lps = torch.zeros((n, length), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[i, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.long)
        attn[i, : p + c] = 1
        if s.in_loss:
            mask = [1] * c if s.loss_mask is None else s.loss_mask
            resp[i, p : p + c] = torch.tensor(mask, dtype=torch.float32)
        lps[i, p : p + c] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    turns = None
    if any(s.turn_rewards for s in samples):
        turns = torch.zeros((n, length), dtype=torch.float32)
        for i, s in enumerate(samples):
            p = len(s.prompt_ids)
            for index, value in s.turn_rewards or ():
                turns[i, p + index] += value
        turns = turns * resp  # a sample out of the loss (overlong masking) earns nothing here
    replicas = None
    if endpoints is not None:
        where = {url: i for i, url in enumerate(endpoints)}
        replicas = torch.tensor([where.get(s.endpoint, -1) for s in samples], dtype=torch.long)
    batch = TensorBatch(ids, attn, resp, lps, adv, rewards, turn_rewards=turns, replicas=replicas)
    return batch if device is None else batch.to(device)


def shard_for_rank(samples: list[TrainSample], rank: int, world_size: int) -> list[TrainSample]:
    """This rank's samples, padded so every rank runs the same number of micro-batches.

    FSDP2 forwards are collective, so a rank with fewer micro-batches would hang the others.
    Padding samples have no completion tokens, so they add nothing to the loss.
    """
    mine = samples[rank::world_size]
    per_rank = -(-len(samples) // world_size)
    filler = TrainSample(samples[0].prompt_ids[:1], [], [], 0.0, 0.0, 0)
    return mine + [filler] * (per_rank - len(mine))
