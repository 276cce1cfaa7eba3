"""Rank 0's half of a step with a scripted engine: overlong handling (issue 13 #8)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.workloads.tiny_models import make_tokenizer
from lorarl.rewards.registry import RewardResult
from lorarl.trainer.data.prompts import DataPosition, PromptDataset, PromptSampler
from lorarl.trainer.generation.rollouts import RolloutWorker
from lorarl.trainer.generation.types import Sample, SamplingParams
from lorarl.trainer.rl.overlong import OverlongConfig, soft_overlong_penalty
from lorarl.trainer.update.batch import collate

MAX = 10


def test_soft_overlong_penalty_is_dapos_linear_ramp():
    cfg = OverlongConfig(max_tokens=MAX, soft_punishment=True, buffer_tokens=4, penalty_factor=1)
    got = soft_overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), cfg)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))


class ScriptedClient:
    """Group of 4 per prompt: lengths 2, 5, MAX (cut), MAX (cut)."""

    def generate(self, prompts, n, params, *, model=None, expected_version=0):
        out = []
        for p in prompts:
            group = []
            for length in (2, 5, MAX, MAX):
                finish = "length" if length == MAX else "stop"
                ids = [7] * length
                group.append(Sample(list(p), ids, [-1.0] * length, finish, 0, "fake"))
            out.append(group)
        return out


def scorer(prompts, completions, truths, metas):
    return [RewardResult(score=1.0 if len(c) >= MAX else 0.0) for c in completions]


def worker(overlong: OverlongConfig | None) -> RolloutWorker:
    data = PromptDataset.from_rows([{"prompt": "a", "answer": "x"}] * 2, "prompt", "answer")
    return RolloutWorker(
        dataset=data, sampler=PromptSampler(2, 2, seed=0, shuffle=False),
        tokenizer=make_tokenizer(), client=ScriptedClient(), scorer=scorer, estimator="grpo",
        group_size=4, max_prompt_tokens=64, sampling=SamplingParams(max_tokens=MAX),
        overlong=overlong,
    )  # fmt: skip


def test_truncated_completions_are_counted_punished_or_masked():
    plain = worker(None).collect(DataPosition(), 0, "base")
    assert plain.truncated_fraction == 0.5
    # The task rewards the cut completions: without handling they get the positive advantage.
    assert [s.advantage > 0 for s in plain.samples[:4]] == [False, False, True, True]

    soft = OverlongConfig(max_tokens=MAX, soft_punishment=True, buffer_tokens=5, penalty_factor=2)
    punished = worker(soft).collect(DataPosition(), 0, "base")
    assert [s.reward for s in punished.samples[:4]] == pytest.approx([0.0, 0.0, -1.0, -1.0])
    assert punished.rewards.tolist()[:4] == [0.0, 0.0, 1.0, 1.0]  # reported: the task's reward
    assert punished.truncated_fraction == 0.5

    masked = worker(OverlongConfig(max_tokens=MAX, mask=True)).collect(DataPosition(), 0, "base")
    batch = collate(masked.samples, pad_id=0)
    assert batch.response_mask.sum(1).tolist()[:4] == [2.0, 5.0, 0.0, 0.0]


class TwoEngineClient(ScriptedClient):
    """The short completions come from engine a, the cut ones from engine b."""

    def generate(self, prompts, n, params, *, model=None, expected_version=0):
        groups = super().generate(prompts, n, params, model=model)
        return [[replace(s, endpoint="http://b" if len(s.completion_ids) == MAX else "http://a")
                 for s in group] for group in groups]  # fmt: skip


def test_each_engines_mean_reward_is_reported_so_a_replica_on_wrong_weights_stands_out():
    w = worker(OverlongConfig(max_tokens=MAX, soft_punishment=True, buffer_tokens=5))
    w.client = TwoEngineClient()
    collected = w.collect(DataPosition(), 0, "base")
    # the task's reward, by the engine that generated the sample (not the overlong penalty)
    assert collected.engine_rewards == {"http://a": 0.0, "http://b": 1.0}


class MixedClient(ScriptedClient):
    """Prompt 0's group: all right, lengths 2, 5, MAX, MAX (the soft punishment separates them).
    Prompt 1's group: one right, three wrong, all short."""

    def generate(self, prompts, n, params, *, model=None, expected_version=0):
        groups = super().generate(prompts, n, params, model=model)
        short = [replace(s, completion_ids=[8] * 2, logprobs=[-1.0] * 2, finish_reason="stop")
                 for s in groups[1]]  # fmt: skip
        short[0] = replace(short[0], completion_ids=[9, 9])
        return [[replace(s, completion_ids=[9] * len(s.completion_ids)) for s in groups[0]], short]


def test_dapo_dynamic_sampling_filters_on_accuracy_unless_told_to_use_the_shaped_reward():
    def right(prompts, completions, truths, metas):
        return [RewardResult(score=float("9" in c)) for c in completions]

    soft = OverlongConfig(max_tokens=MAX, soft_punishment=True, buffer_tokens=5)
    w = worker(soft)
    w.client, w.scorer, w.dynamic_rounds = MixedClient(), right, 1
    w._text = lambda sample: "".join(map(str, sample.completion_ids))  # what `right` reads
    by_accuracy = w.collect(DataPosition(), 0, "base")
    # the all-right group is dropped (no accuracy signal) although its shaped rewards differ
    assert len(by_accuracy.samples) == 4
    assert [s.reward for s in by_accuracy.samples] == [1.0, 0.0, 0.0, 0.0]
    w.dynamic_on_shaped = True
    by_shaped = w.collect(DataPosition(), 0, "base")
    assert len(by_shaped.samples) == 8
    assert [s.reward for s in by_shaped.samples[:4]] == pytest.approx([1.0, 1.0, 0.0, 0.0])
