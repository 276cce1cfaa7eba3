"""The trainer's training data, built from the job: the prompts kept, their sampler and the run's
step count (docs/architecture.md#one-rl-step).

Built in two calls so the files are read (and a bad one fails) before the model loads, and the
prompts are measured with the tokenizer that loads after it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lorarl.api.resource import LoRARLJob
from lorarl.trainer.data.epochs import resolve_total_steps
from lorarl.trainer.data.prompts import PromptDataset, PromptSampler, drop_long_prompts

log = logging.getLogger(__name__)

__all__ = ["TrainData"]


@dataclass(frozen=True)
class TrainData:
    dataset: PromptDataset  # the prompts that fit data.maxPromptTokens
    sampler: PromptSampler
    dropped: int  # prompts over data.maxPromptTokens, left out
    total_steps: int

    @staticmethod
    def read(job: LoRARLJob) -> PromptDataset:
        """Every row of data.trainFiles as a prompt, none dropped yet."""
        data = job.spec.data
        return PromptDataset.from_files(
            data.train_files, data.prompt_key, data.answer_key,
            system_prompt=data.system_prompt, chat_template_kwargs=data.chat_template_kwargs,
        )  # fmt: skip

    @classmethod
    def from_job(
        cls,
        job: LoRARLJob,
        loaded: PromptDataset,
        tokenizer: Any,
        *,
        lengths: Sequence[int] | None = None,
        is_main: bool = True,
    ) -> TrainData:
        """`loaded` (`read`) without the prompts over data.maxPromptTokens (`lengths`: as
        `drop_long_prompts` takes them), and the step count. training.epochs becomes a step
        count now that the rows are known: it is written into this process's
        `job.spec.training.total_steps`, so whatever is built after (the schedules, evals, the
        last checkpoint, progress) sees the real total. `is_main`: the rank that logs."""
        spec = job.spec
        dataset, dropped = drop_long_prompts(
            loaded, tokenizer, spec.data.max_prompt_tokens, lengths=lengths
        )
        if dropped and is_main:
            log.warning(
                "dropped %d of %d prompts longer than data.maxPromptTokens=%d",
                dropped, len(loaded), spec.data.max_prompt_tokens,
            )  # fmt: skip
        total = resolve_total_steps(job, len(dataset))
        if spec.training.epochs is not None and is_main:
            log.info(
                "training.epochs %g over %d prompts at %d per step: %d steps",
                spec.training.epochs, len(dataset), spec.training.prompts_per_step, total,
            )  # fmt: skip
        spec.training.total_steps = total
        sampler = PromptSampler(
            len(dataset), spec.training.prompts_per_step, spec.data.seed, spec.data.shuffle
        )
        return cls(dataset, sampler, dropped, total)
