from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from lorarl.trainer.rl.samples import TrainSample
from lorarl.trainer.update.batch import collate, shard_for_rank


def sample(p: int, c: int, adv: float = 1.0) -> TrainSample:
    return TrainSample(list(range(1, p + 1)), list(range(50, 50 + c)), [-0.5] * c, adv, 1.0, 0)


def test_collate_masks_mark_exactly_the_completion_tokens():
    b = collate([sample(3, 2), sample(1, 4, adv=-1.0)], pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 50, 51], [1, 50, 51, 52, 53]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert b.response_mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]
    assert b.rollout_logprobs[0].tolist() == [0, 0, 0, -0.5, -0.5]
    assert b.advantages.tolist() == [1.0, -1.0]


def test_collate_right_pads_shorter_rows():
    b = collate([sample(2, 1), sample(2, 3)], pad_id=7)
    assert b.input_ids[0].tolist() == [1, 2, 50, 7, 7]
    assert b.attention_mask[0].tolist() == [1, 1, 1, 0, 0]
    assert b.response_mask[0].tolist() == [0, 0, 1, 0, 0]


def test_collate_rejects_an_empty_batch():
    with pytest.raises(ValueError, match="empty"):
        collate([], pad_id=0)


@pytest.mark.parametrize(("n", "world"), [(8, 2), (7, 2), (5, 3), (1, 4)])
def test_every_rank_gets_the_same_number_of_rows_and_every_sample_once(n, world):
    samples = [sample(2, 2, adv=float(i)) for i in range(n)]
    shards = [shard_for_rank(samples, r, world) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # equal micro-batch counts: no FSDP hang
    real = [s.advantage for shard in shards for s in shard if s.completion_ids]
    assert sorted(real) == [float(i) for i in range(n)]
    filler = [s for shard in shards for s in shard if not s.completion_ids]
    assert all(collate([f], 0).response_mask.sum() == 0 for f in filler)  # adds no loss


def test_shard_filler_has_no_response_tokens():
    shard = shard_for_rank([sample(2, 2)], rank=1, world_size=2)
    assert len(shard) == 1 and shard[0].completion_ids == []
    assert torch.count_nonzero(collate(shard, 0).response_mask) == 0


def test_turn_rewards_land_on_their_tokens_and_ppo_puts_the_rest_on_the_last():
    from lorarl.trainer.update.ppo import ppo_token_rewards

    # prompt [9, 9]; completion: model 5 6 | environment 7 7 | model 8
    episode = TrainSample([9, 9], [5, 6, 7, 7, 8], [-0.1] * 5, 0.0, 1.5, 0,
                          loss_mask=[1, 1, 0, 0, 1], turn_rewards=[(1, 0.5)])  # fmt: skip
    single = TrainSample([9], [5], [-0.1], 0.0, 1.0, 0)
    cut = TrainSample([9], [5, 6], [-0.1] * 2, 0.0, 0.25, 0, in_loss=False,
                      loss_mask=[1, 1], turn_rewards=[(0, 0.25)])  # fmt: skip
    batch = collate([episode, single, cut], pad_id=0)
    assert batch.response_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert batch.turn_rewards[0].tolist() == [0, 0, 0, 0.5, 0, 0, 0]
    assert batch.turn_rewards[1:].abs().sum() == 0  # no turns; out of the loss
    tokens = ppo_token_rewards(batch)
    assert tokens[0].tolist() == [0, 0, 0, 0.5, 0, 0, 1.0]  # the episode's total, split
    assert tokens[1].tolist()[1] == 1.0 and tokens[1].sum() == 1.0
    assert tokens[2].abs().sum() == 0
    assert batch.slice(slice(0, 1)).turn_rewards.shape == (1, 7)
    # Without per-turn rewards the whole reward sits on the last token, as before.
    plain = collate([single], pad_id=0)
    assert plain.turn_rewards is None and ppo_token_rewards(plain)[0].tolist() == [0, 1.0]


def test_collate_puts_every_tensor_on_the_trainers_device():
    """A CUDA model scores the batch together with its logits (gather, loss, histogram): a
    host batch failed in the first logprob gather. `meta` stands in for the GPU here."""
    turns = TrainSample([9], [5, 6], [-0.1] * 2, 0.0, 1.0, 0, turn_rewards=[(0, 0.5)])
    batch = collate([sample(3, 2), turns], pad_id=0, device="meta")
    present = [f.name for f in fields(batch) if getattr(batch, f.name) is not None]
    assert {"input_ids", "rollout_logprobs", "rewards", "turn_rewards"} <= set(present)
    assert {getattr(batch, n).device.type for n in present} == {"meta"}
    assert batch.token_advantages is None  # absent stays absent
    host = collate([sample(3, 2)], pad_id=0)
    assert host.to("meta").input_ids.shape == host.input_ids.shape
    assert host.input_ids.device.type == "cpu"  # `to` returns a new batch
