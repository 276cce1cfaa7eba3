"""One rollout sample as training sees it: the record rank 0 builds from generation and every
rank turns into tensors (`update/batch.py`). Plain data, so generation, telemetry and the
update share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainSample:
    """What every rank needs to train on one sample; small enough to broadcast."""

    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: list[float]
    advantage: float
    reward: float
    weight_version: int
    # False: the sample takes no part in the loss (overlong masking); it still counts in its
    # group's advantages, as in DAPO's overlong filtering.
    in_loss: bool = True
    finish_reason: str = ""  # the engine's: "stop" or "length" (for the stored samples)
    # Multi-turn: 1 on the model's tokens, 0 on the environment's, which only give context; their
    # rollout logprobs are placeholders. None: every completion token is the model's.
    loss_mask: list[int] | None = None
    # ppo with environment.turnRewards: (completion index, reward) per turn; `reward` keeps the
    # episode's total, so the last token gets the total minus these.
    turn_rewards: list[tuple[int, float]] | None = None
    # The engine that generated it (its URL; "" for fillers): the update measures the
    # engine-vs-trainer logprob gap per replica, so one serving other weights stands out.
    endpoint: str = ""
