"""Rank 0's half of a step: prompts -> samples -> rewards -> advantages (-> DAPO refill)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from lorarl.trainer.data.prompts import (
    DataError,
    DataPosition,
    PromptDataset,
    PromptSampler,
    encode_prompts,
    prompt_text,
)
from lorarl.trainer.episodes.agents import AgentEpisode, AgentRunner
from lorarl.trainer.episodes.environment import (
    Episode,
    EpisodeRunner,
    episode_rewards,
    episode_stats,
)
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.reward_metrics import RewardMetricMeans
from lorarl.trainer.generation.sampling import round_seed
from lorarl.trainer.generation.types import Sample, SamplingParams
from lorarl.trainer.rl.advantages import compute_advantages
from lorarl.trainer.rl.dynamic_sampling import DynamicSampler
from lorarl.trainer.rl.overlong import OverlongConfig, soft_overlong_penalty, truncated
from lorarl.trainer.rl.samples import TrainSample

log = logging.getLogger(__name__)

# Batches in a row whose every row was skipped before a step gives up (a data problem).
MAX_EMPTY_BATCHES = 8


@dataclass
class Collected:
    samples: list[TrainSample]
    rewards: torch.Tensor  # of every sample generated this step (dropped groups included)
    position: DataPosition
    generate_seconds: float
    reward_seconds: float
    generated_tokens: int
    rounds: int = 1
    truncated_fraction: float = 0.0  # of every sample generated this step
    episode_stats: dict[str, float] | None = None  # multi-turn only (episodes.episode_stats)
    engine_requests: dict[str, int] | None = None  # replica name -> requests (set by the loop)
    engine_rewards: dict[str, float] | None = None  # endpoint -> mean reward (names: the loop)
    skipped_prompts: int = 0  # multi-turn: rows over maxPromptTokens at run time, not trained
    reward_metrics: dict[str, float] | None = None  # the reward's own metrics, step means


@dataclass
class RolloutWorker:
    dataset: PromptDataset
    sampler: PromptSampler
    tokenizer: Any  # a Hugging Face tokenizer (their decode is typed str | list[str])
    client: RolloutClient
    scorer: Callable  # (prompts, completions, truths, metadatas) -> list[RewardResult]
    estimator: str
    group_size: int
    max_prompt_tokens: int
    sampling: SamplingParams
    dynamic_rounds: int = 0  # 0: dynamic sampling off
    # dynamic sampling keeps groups whose task rewards differ (DAPO's accuracy filter); True:
    # whose shaped rewards (after the soft overlong punishment) differ
    dynamic_on_shaped: bool = False
    overlong: OverlongConfig | None = None  # None: truncated samples are treated like others
    episodes: EpisodeRunner | None = None  # spec.environment: multi-turn episodes per sample
    final_reward: bool = True  # with episodes: add the scorer's score of the last reply
    turn_rewards: bool = False  # with episodes: keep each turn's reward on its token (ppo)
    agents: AgentRunner | None = None  # spec.agent: each recorded model call is a sample

    def collect(
        self, position: DataPosition, version: int, model_name: str, step: int = 0
    ) -> Collected:
        if self.agents is not None:
            return self._collect_agents(position, version, model_name, step)
        gen_s = rew_s = 0.0
        tokens = 0
        all_rewards: list[torch.Tensor] = []
        by_endpoint: dict[str, list[float]] = {}
        n_truncated = n_samples = 0
        skipped = empty_batches = 0
        episodes: list[Episode] = []
        scorer = RewardMetricMeans(self.scorer)  # every sample generated this step, like rewards
        dynamic: DynamicSampler | None = None
        if self.dynamic_rounds:
            dynamic = DynamicSampler(
                self.sampler.batch_size, self.group_size, max_rounds=self.dynamic_rounds
            )
        while True:
            indices, position = self.sampler.next_batch(position)
            items = [self.dataset[i] for i in indices]
            t0 = time.perf_counter()
            params = self._params(step, len(all_rewards))
            if self.episodes is None:  # an episode runner renders its own prompts
                prompt_ids = encode_prompts(
                    self.tokenizer, [it.prompt for it in items], self.max_prompt_tokens,
                    chat_template_kwargs=self.dataset.chat_template_kwargs,
                )  # fmt: skip
                groups = self.client.generate(
                    prompt_ids, self.group_size, params, model=model_name, expected_version=version
                )
                gen_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                rewards = self._score(items, groups, scorer)
            else:
                runs = self.episodes.run(
                    items, self.group_size, params, model=model_name, version=version,
                    seed=_episode_seed(self.sampling.seed, step, len(all_rewards)),
                )  # fmt: skip
                gen_s += time.perf_counter() - t0
                # Rows whose first prompt came out over maxPromptTokens are skipped, not fatal
                # (the load-time filter measures each row with seed 0: a seed-dependent
                # environment can still overflow); the step trains on the others.
                kept = [(it, g) for it, g in zip(items, runs, strict=True) if g]
                skipped += len(items) - len(kept)
                if not kept:
                    empty_batches += 1
                    if empty_batches > MAX_EMPTY_BATCHES:
                        raise DataError(
                            f"{empty_batches} batches in a row had every prompt over "
                            "data.maxPromptTokens once the environment rendered it: raise "
                            "data.maxPromptTokens"
                        )
                    continue  # the next batch, with the same seeds (nothing was generated)
                items, runs = [it for it, _ in kept], [g for _, g in kept]
                t0 = time.perf_counter()
                final = scorer if self.final_reward else None
                rewards = torch.tensor(episode_rewards(items, runs, final, prompt_text))
                groups = [[e.sample for e in group] for group in runs]
                episodes.extend(e for group in runs for e in group)
            rew_s += time.perf_counter() - t0
            flat = [s for g in groups for s in g]
            tokens += sum(sum(s.loss_mask or [1] * len(s.completion_ids)) for s in flat)
            all_rewards.append(rewards)
            for sample, score in zip(flat, rewards.tolist(), strict=True):
                by_endpoint.setdefault(sample.endpoint, []).append(score)
            cut = truncated([s.finish_reason for s in flat])
            n_truncated, n_samples = n_truncated + int(cut.sum()), n_samples + len(flat)
            task_rewards = rewards
            if self.overlong is not None and self.overlong.soft_punishment:
                lengths = torch.tensor([len(s.completion_ids) for s in flat])
                rewards = rewards + soft_overlong_penalty(lengths, self.overlong)
            if dynamic is None:
                chosen, chosen_rewards = flat, rewards
                break
            dynamic.add(rewards, flat, keep_by=None if self.dynamic_on_shaped else task_rewards)
            if dynamic.ready:
                taken = dynamic.take()
                if taken.n_groups == 0:  # nothing informative: train on zero advantages
                    chosen, chosen_rewards = flat, rewards
                else:
                    chosen, chosen_rewards = taken.samples, taken.rewards
                break
        if skipped:
            log.warning(
                "step %d: skipped %d prompt(s) over data.maxPromptTokens once the environment "
                "rendered them", step, skipped,
            )  # fmt: skip
        advantages = compute_advantages(
            self.estimator, chosen_rewards, self.group_size, token_counts=_token_counts(chosen)
        )
        mask_cut = self.overlong is not None and self.overlong.mask
        samples = [
            _train_sample(
                s,
                float(a),
                float(r),
                in_loss=not (mask_cut and s.finish_reason == "length"),
                turn_rewards=self.turn_rewards,
            )
            for s, a, r in zip(chosen, advantages, chosen_rewards, strict=True)
        ]
        return Collected(
            samples=samples,
            rewards=torch.cat(all_rewards),
            position=position,
            generate_seconds=gen_s,
            reward_seconds=rew_s,
            generated_tokens=tokens,
            rounds=len(all_rewards),
            truncated_fraction=n_truncated / max(n_samples, 1),
            episode_stats=episode_stats(episodes) if self.episodes is not None else None,
            engine_rewards={url: sum(rs) / len(rs) for url, rs in by_endpoint.items()},
            skipped_prompts=skipped,
            reward_metrics=scorer.means(),
        )

    def _params(self, step: int, round_: int) -> SamplingParams:
        """Fresh, reproducible randomness per step and refill round (same seed = same run): each
        round's block of seeds is disjoint from every other round's (`round_seed`)."""
        base = self.sampling.seed
        if base is None:
            return self.sampling
        runner = self.episodes or self.agents
        turns = runner.max_turns if runner is not None else 1
        streams = self.sampler.batch_size * self.group_size * turns
        seed = round_seed(base, step, round_, streams=streams, rounds=max(1, self.dynamic_rounds))
        return replace(self.sampling, seed=seed)

    def _collect_agents(
        self, position: DataPosition, version: int, model_name: str, step: int
    ) -> Collected:
        """Agent episodes (spec.agent): each recorded call is a sample with its episode's reward
        and advantage (the group: the groupSize episodes of one prompt; ppo: the reward from that
        call on, and a merged episode's call rewards on their tokens). A group with a failed
        episode is dropped and counted; a batch where every group failed is replaced by the
        next one, up to MAX_EMPTY_BATCHES in a row."""
        assert self.agents is not None
        t0 = time.perf_counter()
        failed = empty_batches = 0
        while True:
            indices, position = self.sampler.next_batch(position)
            items = [self.dataset[i] for i in indices]
            runs = self.agents.run(
                items, self.group_size, self._params(step, empty_batches), model=model_name,
                version=version, seed=_episode_seed(self.sampling.seed, step, empty_batches),
            )  # fmt: skip
            failed += len(self.agents.failures)
            groups = [g for g in runs if g]
            if groups:
                break
            empty_batches += 1
            if empty_batches > MAX_EMPTY_BATCHES:
                raise RuntimeError(
                    f"every agent episode group failed in {empty_batches} batches in a row; "
                    f"first failure: {self.agents.failures[:1]}"
                )
        gen_s = time.perf_counter() - t0
        flat: list[AgentEpisode] = [e for g in groups for e in g]
        rewards = torch.tensor([e.reward for e in flat], dtype=torch.float32)
        counts = [sum(_token_counts(e.calls)) for e in flat]  # the trained tokens
        advantages = compute_advantages(
            self.estimator, rewards, self.group_size, token_counts=counts
        )
        mask_cut = self.overlong is not None and self.overlong.mask
        samples: list[TrainSample] = []
        by_endpoint: dict[str, list[float]] = {}
        sums: dict[str, float] = {}
        seen: dict[str, int] = {}
        for e, a in zip(flat, advantages.tolist(), strict=True):
            for call, reward in zip(e.calls, e.returns, strict=True):
                in_loss = not (mask_cut and call.finish_reason == "length")
                samples.append(
                    _train_sample(call, float(a), reward, in_loss=in_loss, turn_rewards=True)
                )
                by_endpoint.setdefault(call.endpoint, []).append(e.reward)
            for name, value in e.metrics.items():
                sums[name], seen[name] = sums.get(name, 0.0) + value, seen.get(name, 0) + 1
        calls = [c for e in flat for c in e.calls]
        return Collected(
            samples=samples,
            rewards=rewards,
            position=position,
            generate_seconds=gen_s,
            reward_seconds=0.0,
            generated_tokens=sum(e.generated for e in flat),
            rounds=empty_batches + 1,
            truncated_fraction=sum(c.finish_reason == "length" for c in calls) / max(len(calls), 1),
            # model calls per episode, whether trained per call, merged or excluded
            episode_stats={
                "turns_mean": sum(e.n_calls for e in flat) / len(flat),
                "failed_episodes": failed,
            },
            engine_rewards={url: sum(rs) / len(rs) for url, rs in by_endpoint.items()},
            reward_metrics={k: sums[k] / seen[k] for k in sums} or None,
        )

    def _score(self, items, groups: list[list[Sample]], scorer=None) -> torch.Tensor:
        prompts, completions, truths, metas = [], [], [], []
        for item, group in zip(items, groups, strict=True):
            for s in group:
                prompts.append(prompt_text(item.prompt))
                completions.append(self._text(s))
                truths.append(item.answer)
                metas.append(item.metadata)
        results = (scorer or self.scorer)(prompts, completions, truths, metas)
        return torch.tensor([r.score for r in results], dtype=torch.float32)

    def _text(self, sample: Sample) -> str:
        return self.tokenizer.decode(sample.completion_ids, skip_special_tokens=True)


def _token_counts(samples: list[Sample]) -> list[int]:
    """Each sample's response tokens: the model's own (an episode's loss mask), what REINFORCE++
    whitens over."""
    return [sum(s.loss_mask) if s.loss_mask is not None else len(s.completion_ids) for s in samples]


def _episode_seed(seed: int | None, step: int, round_: int) -> int:
    """Environments' randomness: reproducible per job seed, step and refill round."""
    return ((seed or 0) * 1_000_003 + step * 7_919 + round_) % 2**31 * 4096


def _train_sample(
    s: Sample, advantage: float, reward: float, in_loss: bool = True, turn_rewards: bool = False
) -> TrainSample:
    return TrainSample(
        prompt_ids=list(s.prompt_ids),
        completion_ids=list(s.completion_ids),
        rollout_logprobs=list(s.logprobs),
        advantage=advantage,
        reward=reward,
        weight_version=s.weight_version,
        in_loss=in_loss,
        finish_reason=s.finish_reason or "",
        loss_mask=None if s.loss_mask is None else list(s.loss_mask),
        turn_rewards=list(s.turn_rewards) if turn_rewards and s.turn_rewards else None,
        endpoint=s.endpoint or "",
    )
