"""`training.epochs`: the step count of a job that gives passes over the data, not steps.

Only the trainer knows the rows it trains on (the files read, and prompts over
data.maxPromptTokens dropped), so the count is made here, once the data is loaded:

    totalSteps = ceil(epochs x rows / promptsPerStep)

computed exactly (0.1 epochs of 30 rows at 3 per step is 1 step, not 2), at least 1. The rules
that read totalSteps and could not be checked at admission (critic.warmupSteps) are checked
here.
"""

from __future__ import annotations

import math
from fractions import Fraction

from lorarl.api.resource import LoRARLJob
from lorarl.trainer.errors import ConfigError

__all__ = ["resolve_total_steps", "steps_for_epochs"]


def steps_for_epochs(epochs: float, rows: int, prompts_per_step: int) -> int:
    if rows <= 0:
        raise ConfigError("training.epochs: the training data holds no prompts to count")
    exact = Fraction(repr(float(epochs))) * rows / prompts_per_step
    return max(1, math.ceil(exact))


def resolve_total_steps(job: LoRARLJob, rows: int) -> int:
    """The job's step count: training.totalSteps, or the count for training.epochs over `rows`
    training prompts."""
    training = job.spec.training
    if training.epochs is None:
        assert training.steps is not None  # totalSteps, or the default without epochs
        return training.steps
    total = steps_for_epochs(training.epochs, rows, training.prompts_per_step)
    critic = job.spec.critic
    if critic is not None and critic.warmup_steps >= total:
        raise ConfigError(
            f"critic.warmupSteps ({critic.warmup_steps}) must be less than the run's "
            f"{total} steps (training.epochs {training.epochs:g} x {rows} prompts / "
            f"promptsPerStep {training.prompts_per_step}): the actor would never be trained"
        )
    return total
