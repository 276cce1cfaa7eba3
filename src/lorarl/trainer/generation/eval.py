"""Evaluation on data.valFiles: the engines, at the weights of a step, sample `n` completions per
validation prompt; the job's reward scores them (docs/architecture.md#evaluation).

Evals run on rank 0 through the same RolloutClient as training rollouts, but never touch the
training sampler, its data position or the dynamic-sampling refill: their samples are never
trained on and their time is not part of any train step. Every eval uses the same seed, so two
evals differ only by the weights.

Each eval also reports its numbers per data source (the rows' `data_source`, as verl's parquet
has it) and keeps its completions in outputDir/evals/step-<N>.jsonl (docs/tracking.md).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl.api.reports.status import EvalRecord, SourceEval
from lorarl.api.resource import LoRARLJob
from lorarl.trainer.data.prompts import (
    PromptDataset,
    PromptItem,
    drop_long_prompts,
    encode_prompts,
    prompt_text,
)
from lorarl.trainer.episodes.environment import EpisodeRunner, episode_rewards
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.sampling import eval_sampling
from lorarl.trainer.generation.types import Sample, SamplingParams

log = logging.getLogger(__name__)

EVALS_DIR = "evals"  # under training.outputDir: step-<N>.jsonl, one file per eval
# What an eval file keeps: whole prompt groups, in validation order, up to this many completions
# (the rest of the prompts are scored and counted, not saved), each text cut at SAVED_TEXT_LIMIT
# characters: an eval file stays under ~20 MB whatever the validation set.
MAX_SAVED_COMPLETIONS = 4096
SAVED_TEXT_LIMIT = 2000
SOURCE_KEY = "data_source"  # the row column naming a prompt's data source (verl's)
NO_SOURCE = "unknown"  # by_source's name for rows without a data_source
MAX_SOURCES = 64  # by_source keeps the largest sources; the rest count as OTHER_SOURCES
OTHER_SOURCES = "other"


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


def source_key(value: Any) -> str:
    """A data source as a metric-name segment every tracker accepts (MLflow is the strictest:
    letters, digits, `_ - . /`, no empty or dot-only path parts): `openai/gsm8k` stays."""
    if value is None:
        return NO_SOURCE
    parts = (re.sub(r"[^\w.\-]+", "_", p) for p in str(value).split("/"))
    key = "/".join(p for p in parts if p.strip("."))[:100].strip("/")
    return key or NO_SOURCE


def source_metrics(
    rewards: Sequence[Sequence[float]], sources: Sequence[Any], threshold: float
) -> dict[str, SourceEval]:
    """Reward mean, accuracy and prompt count per data source (`sources[i]` is prompt i's
    `data_source`, None without one), by source name; past MAX_SOURCES, the smallest sources
    are counted together as OTHER_SOURCES."""
    if len(sources) != len(rewards):
        raise ValueError(f"{len(rewards)} prompts but {len(sources)} data sources")
    groups: dict[str, list[Sequence[float]]] = {}
    for source, group in zip(sources, rewards, strict=True):
        groups.setdefault(source_key(source), []).append(group)
    if len(groups) > MAX_SOURCES:
        ranked = sorted(groups, key=lambda name: (-len(groups[name]), name))
        kept = {name: groups[name] for name in ranked[: MAX_SOURCES - 1]}
        rest = [g for name in ranked[MAX_SOURCES - 1 :] for g in groups[name]]
        groups = {**kept, OTHER_SOURCES: kept.get(OTHER_SOURCES, []) + rest}
    out: dict[str, SourceEval] = {}
    for name in sorted(groups):
        flat = [r for group in groups[name] for r in group]
        out[name] = SourceEval(
            reward_mean=sum(flat) / len(flat),
            accuracy=sum(r >= threshold for r in flat) / len(flat),
            prompts=len(groups[name]),
        )
    return out


def aggregate(
    rewards: Sequence[Sequence[float]],
    threshold: float,
    *,
    step: int,
    seconds: float,
    sources: Sequence[Any] | None = None,
) -> EvalRecord:
    """One EvalRecord from the rewards of each prompt's samples (all groups the same size);
    with `sources` (each prompt's data_source, None without one), also by source, unless no
    prompt has one."""
    if not rewards or not rewards[0]:
        raise ValueError("an eval needs at least one prompt with at least one sample")
    n = len(rewards[0])
    if any(len(group) != n for group in rewards):
        raise ValueError(f"every prompt needs {n} samples, got {[len(g) for g in rewards]}")
    correct = [sum(r >= threshold for r in group) for group in rewards]
    flat = [r for group in rewards for r in group]
    has_sources = sources is not None and any(s is not None for s in sources)
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
        by_source=source_metrics(rewards, sources, threshold) if sources and has_sources else {},
    )


def eval_file(save_dir: Path, step: int) -> Path:
    return save_dir / f"step-{step:06d}.jsonl"


def generation_rows(
    step: int,
    items: Sequence[PromptItem],
    completions: Sequence[Sequence[str]],
    rewards: Sequence[Sequence[float]],
    limit: int = MAX_SAVED_COMPLETIONS,
) -> list[dict[str, Any]]:
    """One row per prompt (its text, answer, data_source, completions and their rewards), whole
    prompt groups in order while they fit in `limit` completions (at least the first prompt's,
    cut to `limit`); texts cut at SAVED_TEXT_LIMIT characters."""
    rows: list[dict[str, Any]] = []
    left = limit
    for i, (item, texts, scores) in enumerate(zip(items, completions, rewards, strict=True)):
        if rows and len(texts) > left:
            break
        source = item.metadata.get(SOURCE_KEY)
        rows.append({
            "step": step,
            "index": i,
            "data_source": None if source is None else str(source),
            "prompt": prompt_text(item.prompt)[:SAVED_TEXT_LIMIT],
            "answer": item.answer,
            "completions": [t[:SAVED_TEXT_LIMIT] for t in texts[:left]],
            "rewards": list(scores[:left]),
        })  # fmt: skip
        left -= len(rows[-1]["completions"])
        if left <= 0:
            break
    return rows


def write_generations(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Write an eval file atomically (temp file, fsync, rename): a reader never sees half of
    one, and a resumed run's redone eval replaces the old file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:  # default=str: an answer column may hold dates, numpy scalars, ...
            f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_generations(path: Path) -> list[dict[str, Any]]:
    """An eval file's rows (see generation_rows)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


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
    save_dir: Path | None = None  # where each eval's completions go (None: not saved)

    def run(self, step: int, version: int, model_name: str) -> EvalRecord:
        """Evaluate the weights `version` the engines serve as `model_name`; raises on an
        engine or reward error (the caller decides that a failed eval does not fail the run).
        Its completions are saved to save_dir/step-<N>.jsonl (a failed write only warns)."""
        t0 = time.perf_counter()
        items = list(self.dataset)
        texts: list[list[str]] | None = None
        if self.episodes is not None:  # the same seed every eval, like the sampling's
            runs = self.episodes.run(
                items, self.n, self.sampling, model=model_name, version=version, seed=0
            )
            scorer = self.scorer if self.final_reward else None
            flat = episode_rewards(items, runs, scorer, prompt_text)
            samples = [[e.sample for e in group] for group in runs]
        else:
            prompt_ids = encode_prompts(
                self.tokenizer, [it.prompt for it in items], self.max_prompt_tokens,
                chat_template_kwargs=self.dataset.chat_template_kwargs,
            )  # fmt: skip
            samples = self.client.generate(
                prompt_ids, self.n, self.sampling, model=model_name, expected_version=version
            )
            texts = self._decode(samples)
            flat = self._score(items, texts)
        rewards = [flat[i * self.n : (i + 1) * self.n] for i in range(len(items))]
        sources = [it.metadata.get(SOURCE_KEY) for it in items]
        record = aggregate(
            rewards, self.threshold, step=step, seconds=time.perf_counter() - t0, sources=sources
        )
        if self.save_dir is not None:
            texts = self._decode(samples) if texts is None else texts
            self._save(self.save_dir, step, items, texts, rewards)
        return record

    def _decode(self, groups: Sequence[Sequence[Sample]]) -> list[list[str]]:
        decode = self.tokenizer.decode
        return [[decode(s.completion_ids, skip_special_tokens=True) for s in g] for g in groups]

    def _score(self, items: Sequence[PromptItem], texts: list[list[str]]) -> list[float]:
        prompts, completions, truths, metas = [], [], [], []
        for item, group in zip(items, texts, strict=True):
            for text in group:
                prompts.append(prompt_text(item.prompt))
                completions.append(text)
                truths.append(item.answer)
                metas.append(item.metadata)
        return [float(r.score) for r in self.scorer(prompts, completions, truths, metas)]

    @staticmethod
    def _save(save_dir: Path, step: int, items, texts, rewards) -> None:
        path = eval_file(save_dir, step)
        try:
            write_generations(path, generation_rows(step, items, texts, rewards))
        except OSError as exc:  # the numbers are still reported; only the file is missing
            log.warning("could not save the eval's completions to %s: %s", path, exc)


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
        save_dir=Path(t.output_dir) / EVALS_DIR,
    )
