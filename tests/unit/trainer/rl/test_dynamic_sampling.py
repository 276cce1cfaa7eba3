"""DAPO dynamic sampling: which groups count, and how a batch fills across rounds."""

from __future__ import annotations

import pytest
import torch

from lorarl.trainer.rl.advantages import grpo_advantages
from lorarl.trainer.rl.dynamic_sampling import DynamicSampler, informative_groups


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_informative_groups():
    # [1,0] differs; [1,1] and [0,0] are flat; [.5, .5000001] differs by 1e-7 < atol 1e-6
    rewards = t([1, 0, 1, 1, 0, 0, 0.5, 0.5000001])
    assert informative_groups(rewards, 2).tolist() == [True, False, False, False]
    assert informative_groups(rewards, 2, atol=0.0).tolist() == [True, False, False, True]
    assert informative_groups(t([1, 1, 0, 0, 0, 0]), 3).tolist() == [True, False]


def test_informative_groups_rejects_bad_input():
    with pytest.raises(ValueError, match="group_size 2 does not divide the batch of 3"):
        informative_groups(t([1, 0, 1]), 2)
    with pytest.raises(ValueError, match="atol must be >= 0"):
        informative_groups(t([1, 0]), 2, atol=-1.0)


def test_sampler_fills_across_rounds_in_order_and_caps():
    s = DynamicSampler(target_groups=3, group_size=2, max_rounds=5)
    # round 1: group a informative, group b flat -> keep 1, drop 1
    assert s.add(t([1, 0, 1, 1]), ["a0", "a1", "b0", "b1"]) == 1
    assert (s.ready, s.needed, s.kept_groups) == (False, 2, 1)
    # round 2: c flat (dropped), d and e fill the batch, f is informative but surplus
    kept = s.add(t([0, 0, 0, 1, 1, 0, 0.3, 0.7]), ["c0", "c1", "d0", "d1", "e0", "e1", "f0", "f1"])
    assert kept == 2 and s.ready
    batch = s.take()
    assert batch.samples == ["a0", "a1", "d0", "d1", "e0", "e1"]
    assert batch.rewards.tolist() == [1, 0, 0, 1, 1, 0]
    counts = (batch.n_groups, batch.rounds, batch.dropped_groups, batch.surplus_groups)
    assert counts == (3, 2, 2, 1)
    assert batch.reached_target
    # every kept group carries signal: no zero advantages left
    assert (grpo_advantages(batch.rewards, 2) != 0).all()
    # take() starts over
    assert (s.ready, s.rounds, s.kept_groups, s.dropped_groups) == (False, 0, 0, 0)


def test_sampler_gives_up_after_max_rounds_and_says_so():
    s = DynamicSampler(target_groups=2, group_size=2, max_rounds=2)
    s.add(t([1, 1, 0, 0]), list(range(4)))
    assert not s.ready
    s.add(t([1, 0, 1, 1]), list(range(4, 8)))
    assert s.ready and s.needed == 1
    batch = s.take()
    assert not batch.reached_target
    assert (batch.n_groups, batch.rounds, batch.dropped_groups) == (1, 2, 3)
    assert batch.samples == [4, 5]


def test_sampler_nothing_informative_gives_empty_batch():
    s = DynamicSampler(target_groups=1, group_size=2, max_rounds=1)
    s.add(t([1, 1]), ["x", "y"])
    batch = s.take()
    assert (batch.n_groups, batch.samples, batch.rewards.numel()) == (0, [], 0)
    assert not batch.reached_target


def test_sampler_misuse_is_refused():
    s = DynamicSampler(target_groups=1, group_size=2, max_rounds=3)
    with pytest.raises(RuntimeError, match=r"not ready: 0/1 groups after 0/3 rounds"):
        s.take()
    with pytest.raises(ValueError, match="samples has 3 items but rewards has 2"):
        s.add(t([1, 0]), ["a", "b", "c"])
    with pytest.raises(ValueError, match="does not divide"):
        s.add(t([1, 0, 1]), ["a", "b", "c"])
    assert s.rounds == 0  # rejected rounds are not counted
    s.add(t([1, 0]), ["a", "b"])
    with pytest.raises(RuntimeError, match="call take"):
        s.add(t([1, 0]), ["c", "d"])


def test_sampler_force_take_before_ready():
    s = DynamicSampler(target_groups=4, group_size=2, max_rounds=3)
    s.add(t([1, 0]), ["a", "b"])
    batch = s.take(force=True)
    assert (batch.n_groups, batch.reached_target, batch.samples) == (1, False, ["a", "b"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_groups": 0, "group_size": 2, "max_rounds": 1}, "target_groups must be >= 1"),
        ({"target_groups": 1, "group_size": 1, "max_rounds": 1}, "group_size must be >= 2"),
        ({"target_groups": 1, "group_size": 2, "max_rounds": 0}, "max_rounds must be >= 1"),
    ],
)
def test_sampler_rejects_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicSampler(**kwargs)


def test_keep_by_decides_which_groups_stay_and_rewards_ride_along():
    s = DynamicSampler(target_groups=2, group_size=2, max_rounds=1)
    rewards = torch.tensor([0.5, 1.0, 0.0, 0.0, 1.0, 0.0])  # shaped
    accuracy = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    assert s.add(rewards, list("abcdef"), keep_by=accuracy) == 1
    batch = s.take()
    assert batch.samples == ["e", "f"] and batch.rewards.tolist() == [1.0, 0.0]
    assert batch.dropped_groups == 2
    with pytest.raises(ValueError, match="keep_by shape"):
        DynamicSampler(1, 2, max_rounds=1).add(rewards, list("abcdef"), keep_by=accuracy[:4])
