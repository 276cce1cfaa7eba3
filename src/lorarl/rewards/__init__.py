"""Reward functions: built-in verifiable rewards and a registry that resolves job-spec names."""

from lorarl.rewards.registry import (
    BoundReward,
    RewardError,
    RewardFn,
    RewardResult,
    get_reward,
    list_rewards,
    register,
    register_factory,
    score_batch,
)

__all__ = [
    "BoundReward",
    "RewardError",
    "RewardFn",
    "RewardResult",
    "get_reward",
    "list_rewards",
    "register",
    "register_factory",
    "score_batch",
]
