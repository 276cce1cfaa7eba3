"""Evaluation on data.valFiles: the engines, at the weights of a step, sample `n` completions per
validation prompt; the job's reward scores them (docs/architecture.md#evaluation).

Evals run on rank 0 through the same RolloutClient as training rollouts, but never touch the
training sampler, its data position or the dynamic-sampling refill: their samples are never
trained on and their time is not part of any train step. Every eval uses the same seed, so two
evals differ only by the weights.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lorarl.api.reports.status import EvalRecord
from lorarl.api.resource import LoRARLJob
from lorarl.trainer.data.prompts import (
    PromptDataset,
    drop_long_prompts,
    encode_prompts,
    prompt_text,
)
from lorarl.trainer.episodes.environment import EpisodeRunner, episode_rewards
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.sampling import eval_sampling
from lorarl.trainer.generation.types import Sample, SamplingParams

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code"): 1 - C(n-c, k) / C(n, k), as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_for(n: int) -> list[int]:
    """The k reported for n samples per prompt: 1, 2, 4, ... up to n."""
    return [2**i for i in range(n.bit_length()) if 2**i <= n]


def aggregate(
    rewards: Sequence[Sequence[float]], threshold: float, *, step: int, seconds: float
) -> EvalRecord:
    """One EvalRecord from the rewards of each prompt's samples (all groups the same size)."""
    if not rewards or not rewards[0]:
        raise ValueError("an eval needs at least one prompt with at least one sample")
    n = len(rewards[0])
    if any(len(group) != n for group in rewards):
        raise ValueError(f"every prompt needs {n} samples, got {[len(g) for g in rewards]}")
    correct = [sum(r >= threshold for r in group) for group in rewards]
    flat = [r for group in rewards for r in group]
    return EvalRecord(
        step=step,
        reward_mean=sum(flat) / len(flat),
        accuracy=sum(correct) / len(flat),
        pass_at_k={
            str(k): sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in ks_for(n)
        },
        prompts=len(rewards),
        samples_per_prompt=n,
        seconds=seconds,
    )


@dataclass
class Evaluator:
    dataset: PromptDataset
    tokenizer: Any  # a Hugging Face tokenizer (their decode is typed str | list[str])
    client: RolloutClient
    scorer: Callable  # (prompts, completions, truths, metadatas) -> list[RewardResult]
    n: int
    sampling: SamplingParams
    max_prompt_tokens: int
    threshold: float
    episodes: EpisodeRunner | None = None  # spec.environment: evaluate whole episodes
    final_reward: bool = True

    def run(self, step: int, version: int, model_name: str) -> EvalRecord:
        """Evaluate the weights `version` the engines serve as `model_name`; raises on an
        engine or reward error (the caller decides that a failed eval does not fail the run)."""
        t0 = time.perf_counter()
        items = list(self.dataset)
        if self.episodes is not None:  # the same seed every eval, like the sampling's
            runs = self.episodes.run(
                items, self.n, self.sampling, model=model_name, version=version, seed=0
            )
            scorer = self.scorer if self.final_reward else None
            flat = episode_rewards(items, runs, scorer, prompt_text)
            rewards = [flat[i * self.n : (i + 1) * self.n] for i in range(len(items))]
            return aggregate(rewards, self.threshold, step=step, seconds=time.perf_counter() - t0)
        prompt_ids = encode_prompts(
            self.tokenizer, [it.prompt for it in items], self.max_prompt_tokens,
            chat_template_kwargs=self.dataset.chat_template_kwargs,
        )  # fmt: skip
        groups = self.client.generate(
            prompt_ids, self.n, self.sampling, model=model_name, expected_version=version
        )
        rewards = self._score(items, groups)
        return aggregate(rewards, self.threshold, step=step, seconds=time.perf_counter() - t0)

    def _score(self, items, groups: list[list[Sample]]) -> list[list[float]]:
        prompts, completions, truths, metas = [], [], [], []
        for item, group in zip(items, groups, strict=True):
            for s in group:
                prompts.append(prompt_text(item.prompt))
                completions.append(
                    self.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
                )
                truths.append(item.answer)
                metas.append(item.metadata)
        scores = [float(r.score) for r in self.scorer(prompts, completions, truths, metas)]
        return [scores[i * self.n : (i + 1) * self.n] for i in range(len(items))]


def shared_prompts(val: PromptDataset, train: PromptDataset) -> int:
    """How many validation prompts are also training prompts (an eval on them measures recall)."""
    key = lambda it: json.dumps(it.prompt, sort_keys=True)  # noqa: E731
    seen = {key(it) for it in train}
    return sum(key(it) in seen for it in val)


def build_evaluator(
    job: LoRARLJob,
    tokenizer,
    client: RolloutClient,
    scorer: Callable,
    train: SamplingParams,
    train_prompts: PromptDataset | None = None,
    episodes: EpisodeRunner | None = None,
) -> Evaluator | None:
    """The job's eval (None when evals are off): data.valFiles loaded like trainFiles, sampled
    with training.eval's settings and the train sampling's seed and stops (eval_sampling).
    Validation prompts that are also in `train_prompts` are reported, not removed."""
    spec = job.spec
    t, e = spec.training, spec.training.eval
    if not (t.eval_interval or t.eval_before_train):
        return None
    loaded = PromptDataset.from_files(
        spec.data.val_files, spec.data.prompt_key, spec.data.answer_key,
        system_prompt=spec.data.system_prompt,
        chat_template_kwargs=spec.data.chat_template_kwargs,
    )  # fmt: skip
    dataset, dropped = drop_long_prompts(loaded, tokenizer, spec.data.max_prompt_tokens)
    if dropped:
        log.warning(
            "dropped %d of %d validation prompts longer than data.maxPromptTokens=%d",
            dropped, len(loaded), spec.data.max_prompt_tokens,
        )  # fmt: skip
    if e.max_prompts is not None and e.max_prompts < len(dataset):
        dataset = PromptDataset(
            list(dataset)[: e.max_prompts], dataset.source, dataset.chat_template_kwargs
        )
    if train_prompts is not None and (shared := shared_prompts(dataset, train_prompts)):
        log.warning(
            "%d of %d validation prompts are also training prompts: their eval measures recall",
            shared, len(dataset),
        )  # fmt: skip
    sampling = eval_sampling(spec, train)
    return Evaluator(
        dataset=dataset,
        tokenizer=tokenizer,
        client=client,
        scorer=scorer,
        n=e.n,
        sampling=sampling,
        max_prompt_tokens=spec.data.max_prompt_tokens,
        threshold=e.correct_threshold,
        episodes=episodes,
        final_reward=spec.environment is None or spec.environment.final_reward,
    )
