"""No two (prompt, sample) pairs share a vLLM seed stream: not within a request batch (a prompt
repeated in it included), not across DAPO refill rounds, not across steps (issue 35 #4).

vLLM gives the j-th of a request's n samples the request's seed + j, so a request with seed s
and n samples owns the streams s .. s + n - 1; the tests expand every request that way.
"""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

from harness.workloads.tiny_models import make_tokenizer
from lorarl.environments.base import EnvStep
from lorarl.rewards.registry import RewardResult
from lorarl.trainer.data.prompts import DataPosition, PromptDataset, PromptItem, PromptSampler
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.rollouts import RolloutWorker
from lorarl.trainer.generation.sampling import round_seed
from lorarl.trainer.generation.types import SamplingParams


class FakeVllm:
    """/v1/completions over httpx.MockTransport: n one-token choices, every request recorded."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        choices = [
            {"index": j, "text": "x", "finish_reason": "stop",
             "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-1.0]}}
            for j in range(body["n"])
        ]  # fmt: skip
        return httpx.Response(200, json={"model": body["model"], "choices": choices})

    def streams(self) -> list[int]:
        return [r["seed"] + j for r in self.requests for j in range(r["n"])]


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> FakeVllm:
    fake = FakeVllm()
    monkeypatch.setattr(
        RolloutClient,
        "_new_http",
        lambda self: httpx.AsyncClient(transport=httpx.MockTransport(fake)),
    )
    return fake


def test_one_call_gives_every_prompt_its_own_block_of_seeds(engine):
    client = RolloutClient(["http://e"], "vllm", model_name="m")
    prompt = [1, 2, 3]
    # the same prompt three times (a small dataset, or a batch spanning an epoch boundary)
    client.generate([prompt, prompt, [4, 5], prompt], 4, SamplingParams(8, seed=100),
                    expected_version=0)  # fmt: skip
    assert sorted(r["seed"] for r in engine.requests) == [100, 104, 108, 112]
    streams = engine.streams()
    assert len(streams) == 16 and len(set(streams)) == 16


def test_steps_and_refill_rounds_never_reuse_a_stream(engine):
    """Three prompts, four per batch (one repeated), groups of 4, DAPO with 3 rounds that never
    fill (every reward equal), over three steps: 3 * 3 * 16 samples, all on distinct streams."""
    rows = [{"prompt": p, "answer": "x"} for p in ("a", "b", "c")]
    client = RolloutClient(["http://e"], "vllm", model_name="m")
    worker = RolloutWorker(
        dataset=PromptDataset.from_rows(rows, "prompt", "answer"),
        sampler=PromptSampler(3, 4, seed=0, shuffle=False), tokenizer=make_tokenizer(),
        client=client, scorer=lambda p, c, t, m: [RewardResult(1.0) for _ in c],
        estimator="grpo", group_size=4, max_prompt_tokens=64,
        sampling=SamplingParams(8, seed=7), dynamic_rounds=3,
    )  # fmt: skip
    position = DataPosition()
    for step in (1, 2, 3):
        collected = worker.collect(position, 0, "m", step=step)
        assert collected.rounds == 3
        position = collected.position
    streams = engine.streams()
    assert len(streams) == 3 * 3 * 16
    assert len(set(streams)) == len(streams), "two samples drew the same random stream"


def test_round_seed_blocks_are_disjoint_and_follow_the_job_seed():
    blocks = {round_seed(5, step, r, streams=64, rounds=3) for step in range(50) for r in range(3)}
    starts = sorted(blocks)
    assert len(starts) == 150
    assert all(b - a >= 64 for a, b in itertools.pairwise(starts))
    assert round_seed(5, 1, 0, streams=64, rounds=3) != round_seed(6, 1, 0, streams=64, rounds=3)
    with pytest.raises(ValueError, match="round 3 of 3"):
        round_seed(5, 1, 3, streams=64, rounds=3)


class _ThreeTurns:
    def reset(self, item):
        return [{"role": "user", "content": "go"}]

    def step(self, assistant):
        return EnvStep(messages=[{"role": "user", "content": "more"}])


def test_episode_turns_each_get_their_own_stream(engine):
    from lorarl.trainer.episodes.environment import EpisodeRunner
    from lorarl.trainer.episodes.turn_tokens import TurnTokens

    runner = EpisodeRunner(
        client=RolloutClient(["http://e"], "vllm", model_name="m"),
        turn_tokens=TurnTokens(make_tokenizer()), factory=_ThreeTurns, max_turns=3,
        max_total_tokens=512, max_response_tokens=4, timeout_s=30.0,
    )  # fmt: skip
    items = [PromptItem("a"), PromptItem("a"), PromptItem("b")]
    groups = runner.run(items, 4, SamplingParams(4, seed=50), model="m", version=0, seed=9)
    assert all(e.turns == 3 for g in groups for e in g)
    streams = engine.streams()
    assert len(streams) == 3 * 4 * 3 and len(set(streams)) == len(streams)
    assert min(streams) == 50 and max(streams) == 50 + 3 * 4 * 3 - 1
