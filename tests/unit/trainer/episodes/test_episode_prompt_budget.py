"""Multi-turn prompts over data.maxPromptTokens (issue 35 #2): the load-time filter measures what
each environment sends (tool_calling's tool description included), and a row that still comes out
too long at run time is skipped and counted, never fatal, so a resumed job (the deterministic
sampler returns to the same batch) runs through it instead of crashing again."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from harness.workloads.tiny_models import make_tokenizer
from lorarl.api.resource import LoRARLJob
from lorarl.environments.base import EnvStep, item_messages
from lorarl.rewards.registry import RewardResult
from lorarl.trainer.data.prompts import (
    DataPosition,
    PromptDataset,
    PromptSampler,
    drop_long_prompts,
)
from lorarl.trainer.episodes.environment import EpisodeRunner, episode_prompt_lengths
from lorarl.trainer.episodes.turn_tokens import TurnTokens
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.rollouts import RolloutWorker
from lorarl.trainer.generation.types import SamplingParams
from lorarl.trainer.telemetry.progress import ProgressTracker
from lorarl.trainer.telemetry.step_record import step_record

ROWS = [{"prompt": f"question {c}" + " more" * i, "answer": "x"} for i, c in enumerate("abcdef")]


def _job(**environment) -> LoRARLJob:
    return LoRARLJob.model_validate({
        "apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob", "metadata": {"name": "mt"},
        "spec": {"model": {"path": "/models/m"}, "data": {"trainFiles": ["t.jsonl"]},
                 "environment": {"entrypoint": "tool_calling", **environment}},
    })  # fmt: skip


def test_the_load_time_filter_counts_the_tool_description():
    tok = make_tokenizer()
    data = PromptDataset.from_rows(ROWS, "prompt", "answer")
    raw = max(len(TurnTokens(tok).prompt(item_messages(it.prompt))) for it in data)
    sent = episode_prompt_lengths(_job(), tok, list(data))
    assert sent is not None and min(sent) > raw + 50  # the tool description is long
    limit = raw + 10  # every raw prompt fits, none with its tool description
    kept, dropped = drop_long_prompts(data, tok, limit)
    assert dropped == 0 and len(kept) == 6  # the old measure lets all of them through
    with pytest.raises(Exception, match="all 6 prompts are longer"):
        drop_long_prompts(data, tok, limit, lengths=sent)
    kept, dropped = drop_long_prompts(data, tok, sorted(sent)[2], lengths=sent)
    assert dropped == 3 and len(kept) == 3


class _LongForSomeSeeds:
    """Row 'question c' gets a long system message for every seed but 0: the load-time filter
    (seed 0) keeps it and it overflows at run time, as a seed-dependent environment can."""

    def reset(self, item):
        messages = item_messages(item.prompt)
        if "question c" in messages[-1]["content"] and item.seed != 0:
            messages.insert(0, {"role": "system", "content": "padding " * 200})
        return messages

    def step(self, assistant):
        return EnvStep(done=True)


class FakeVllm:
    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.prompts.append(body["prompt"])
        choices = [
            {"index": j, "text": "x", "finish_reason": "stop",
             "logprobs": {"tokens": [f"token_id:{5 + j}"], "token_logprobs": [-1.0]}}
            for j in range(body["n"])
        ]  # fmt: skip
        return httpx.Response(200, json={"model": body["model"], "choices": choices})


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> FakeVllm:
    fake = FakeVllm()
    monkeypatch.setattr(
        RolloutClient, "_new_http",
        lambda self: httpx.AsyncClient(transport=httpx.MockTransport(fake)),
    )  # fmt: skip
    return fake


def _worker(data: PromptDataset, limit: int) -> RolloutWorker:
    """What a (re)started trainer builds: a fresh worker over the same data and sampler."""
    tok = make_tokenizer()
    runner = EpisodeRunner(
        client=RolloutClient(["http://e"], "vllm", model_name="m"),
        turn_tokens=TurnTokens(tok), factory=_LongForSomeSeeds, max_turns=1,
        max_total_tokens=16, max_response_tokens=4, timeout_s=30.0, max_prompt_tokens=limit,
    )  # fmt: skip
    return RolloutWorker(
        dataset=data, sampler=PromptSampler(len(data), 3, seed=0, shuffle=False), tokenizer=tok,
        client=runner.client, scorer=lambda p, c, t, m: [RewardResult(float(i % 2))
                                                         for i in range(len(c))],
        estimator="grpo", group_size=2, max_prompt_tokens=limit,
        sampling=SamplingParams(4, seed=1), episodes=runner,
    )  # fmt: skip


def test_a_row_over_the_budget_at_run_time_is_skipped_counted_and_a_resume_goes_through_it(
    engine, tmp_path: Path
):
    tok = make_tokenizer()
    data = PromptDataset.from_rows(ROWS, "prompt", "answer")
    lengths = [len(TurnTokens(tok).prompt(item_messages(it.prompt))) for it in data]
    limit = max(lengths) + 5
    data, dropped = drop_long_prompts(data, tok, limit, lengths=lengths)
    assert dropped == 0
    # step 1 trains on rows a, b, c: c's environment comes out too long
    first = _worker(data, limit).collect(DataPosition(), 0, "m", step=1)
    assert first.skipped_prompts == 1
    assert len(first.samples) == 4 and first.rewards.numel() == 4  # rows a and b, 2 each
    assert all(len(p) <= limit for p in engine.prompts)
    record = step_record(1, first, _METRICS, train_s=0.1, sync=None, t_start=0.0, lr=1e-5)
    assert record.skipped_prompts == 1
    tracker = ProgressTracker("mt", 3, tmp_path)
    tracker.record(record, None)
    assert tracker.progress.skipped_prompts == 1
    # The job restarts from a checkpoint taken before step 1: the sampler hands out the same
    # batch, and it goes through the same way instead of crashing again.
    again = _worker(data, limit).collect(DataPosition(), 0, "m", step=1)
    assert again.skipped_prompts == 1 and again.position == first.position
    assert [s.prompt_ids for s in again.samples] == [s.prompt_ids for s in first.samples]
    # ... and the restarted tracker keeps the count of the steps it stands on
    restarted = ProgressTracker("mt", 3, tmp_path)
    restarted.resume(1)
    assert restarted.progress.skipped_prompts == 1
    # the next step (rows d, e, f) has nothing to skip
    second = _worker(data, limit).collect(first.position, 0, "m", step=2)
    assert second.skipped_prompts == 0 and len(second.samples) == 6


_METRICS = {
    "trained_tokens": 4.0, "clip_frac_first_update": 0.0, "grad_norm": 0.0,
    "logprob_mismatch": 0.0, "logprob_mismatch_p50": 0.0, "logprob_mismatch_p90": 0.0,
    "logprob_mismatch_p99": 0.0,
}  # fmt: skip
