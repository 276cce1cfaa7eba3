"""Multi-turn episodes against a real HTTP engine (the tiny HF engine): the trajectory is the
engine's own tokens plus the environment's, masked, and the trainer scores the model's tokens
exactly as the engine sampled them."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness.engines.hf_engine_server import create_app, serve_in_thread
from harness.workloads.letter_relay import LetterRelay
from harness.workloads.tiny_models import taught_letter_model
from lorarl.environments.base import EnvStep, item_messages
from lorarl.trainer.data.prompts import PromptItem
from lorarl.trainer.episodes.environment import (
    EpisodeRunner,
    busy_seconds,
    episode_rewards,
    episode_stats,
)
from lorarl.trainer.episodes.turn_tokens import TurnTokens
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.rollouts import _train_sample
from lorarl.trainer.generation.types import SamplingParams
from lorarl.trainer.model.logprobs import sequence_logprobs
from lorarl.trainer.update.batch import collate

ITEMS = [PromptItem(f"after {c}", answer=chr(ord(c) + 1)) for c in "abcd"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # Taught to answer "after c" with a letter and stop, so most replies end within 4 tokens.
    model_dir = taught_letter_model(tmp_path_factory.mktemp("m") / "tiny", "abcdefgh", steps=60)
    url, stop = serve_in_thread(create_app(model_dir, served_model_name="base"))
    yield model_dir, url
    stop()


def runner(engine, factory, **overrides) -> EpisodeRunner:
    model_dir, url = engine
    tok = AutoTokenizer.from_pretrained(model_dir)
    settings = dict(max_turns=2, max_total_tokens=64, max_response_tokens=4, timeout_s=60.0)
    settings.update(overrides)
    client = RolloutClient([url], "vllm", model_name="base")
    return EpisodeRunner(client=client, turn_tokens=TurnTokens(tok), factory=factory, **settings)


def test_two_turn_episodes_are_token_exact_and_masked(engine):
    model_dir, _ = engine
    run = runner(engine, LetterRelay)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    groups = run.run(ITEMS, 2, params, model="base", version=0, seed=11)
    episodes = [e for g in groups for e in g]
    assert len(groups) == 4 and all(len(g) == 2 for g in groups)
    tok = run.turn_tokens.tokenizer
    for item, e in ((item, e) for item, g in zip(ITEMS, groups, strict=True) for e in g):
        s = e.sample
        mask = list(s.loss_mask)
        assert len(mask) == len(s.completion_ids) == len(s.logprobs)
        assert s.prompt_ids == run.turn_tokens.prompt(item_messages(item.prompt))
        if e.ending != "done":  # the first reply ran into maxResponseTokens: one turn, cut
            assert e.turns == 1 and e.ending == "length" and set(mask) == {1}
            continue
        # model turn 1 (mask 1), the environment's "after X" (mask 0), model turn 2 (mask 1)
        assert e.turns == 2
        runs = [(k, len(list(g))) for k, g in itertools.groupby(mask)]
        assert [k for k, _ in runs] == [1, 0, 1], runs
        first, env_len = runs[0][1], runs[1][1]
        env_ids = s.completion_ids[first : first + env_len]
        assert env_ids == run.turn_tokens.after_turn(
            s.completion_ids[:first], [{"role": "user", "content": f"after {_target(e, tok)}"}]
        )
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, mask, strict=True) if m == 0)
    assert sum(e.ending == "done" for e in episodes) >= 4, [e.ending for e in episodes]
    # The trainer's logprobs of the model's tokens, scored on the whole trajectory, are the
    # engine's: nothing was re-tokenized between the turns.
    samples = [_train_sample(e.sample, 0.0, 0.0) for e in episodes]
    batch = collate(samples, tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp, _ = sequence_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.response_mask, micro_batch_size=8
        )
    scored = batch.response_mask.bool()
    assert int(scored.sum()) == sum(sum(e.sample.loss_mask) for e in episodes)
    gap = (lp - batch.rollout_logprobs).abs()[scored]
    assert gap.max().item() < 1e-4, gap.max()
    stats = episode_stats(episodes)
    assert stats["turns_mean"] == sum(e.turns for e in episodes) / len(episodes)


def _target(episode, tok) -> str:
    """The letter the environment asked about, read back from the trajectory's text."""
    text = tok.decode(episode.sample.completion_ids, skip_special_tokens=True)
    return text.split("user: after ")[1][0]


def test_same_seed_same_episodes(engine):
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=5)
    a = runner(engine, LetterRelay).run(ITEMS[:2], 2, params, model="base", version=0, seed=1)
    b = runner(engine, LetterRelay).run(ITEMS[:2], 2, params, model="base", version=0, seed=1)
    assert [e.sample.completion_ids for g in a for e in g] == [
        e.sample.completion_ids for g in b for e in g
    ]


class _Slow:
    def reset(self, item):
        return item_messages(item.prompt)

    async def step(self, assistant):
        await asyncio.sleep(30)
        return EnvStep(done=True)


class _SlowSync(_Slow):
    def step(self, assistant):
        time.sleep(20)  # a plain method that hangs: the step must not wait for it
        return EnvStep(done=True)


class _Broken(_Slow):
    def step(self, assistant):
        raise RuntimeError("tool crashed")


class _Chatty(_Slow):
    def step(self, assistant):
        return EnvStep(messages=[{"role": "user", "content": "more"}], reward=0.5)


def test_limits_cut_episodes_and_keep_what_was_done(engine):
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=0)
    t0 = time.monotonic()
    [[slow]] = runner(engine, _Slow, timeout_s=1.0).run(
        ITEMS[:1], 1, params, model="base", version=0, seed=0
    )
    assert time.monotonic() - t0 < 10 and slow.ending == "timeout"
    assert slow.turns == 1 and slow.sample.finish_reason == "length"
    t0 = time.monotonic()
    [[hung]] = runner(engine, _SlowSync, timeout_s=1.0).run(
        ITEMS[:1], 1, params, model="base", version=0, seed=0
    )
    assert time.monotonic() - t0 < 10 and hung.ending == "timeout"
    [[broken]] = runner(engine, _Broken).run(ITEMS[:1], 1, params, model="base", version=0, seed=0)
    assert broken.ending == "error" and broken.turns == 1
    # Each reply takes <= 4 tokens and each environment message ~23: a budget of 40 leaves
    # room for one message, never for a third turn.
    [[chatty]] = runner(engine, _Chatty, max_turns=8, max_total_tokens=40).run(
        ITEMS[:1], 1, params, model="base", version=0, seed=0
    )
    assert chatty.ending == "tokens" and len(chatty.sample.completion_ids) <= 40
    assert chatty.turns == 2 and chatty.env_reward == 0.5 * chatty.turns
    # Each turn's reward is kept on that turn's last model token (ppo's environment.turnRewards).
    mask = chatty.sample.loss_mask
    ends = [i for i, m in enumerate(mask) if m == 1 and (i + 1 == len(mask) or mask[i + 1] == 0)]
    assert chatty.sample.turn_rewards == tuple((i, 0.5) for i in ends) and len(ends) == 2


def test_an_environment_prompt_over_the_prompt_budget_skips_its_row(engine, caplog):
    """Not fatal (issue 35 #2): each such row's group comes back empty (the rollout worker
    skips and counts it) and the log says why."""
    params = SamplingParams(max_tokens=4)
    groups = runner(engine, LetterRelay, max_prompt_tokens=8).run(
        ITEMS[:2], 2, params, model="base", version=0, seed=0
    )
    assert groups == [[], []]
    assert "over data.maxPromptTokens=8" in caplog.text and "raise data.maxPrompt" in caplog.text


def test_episode_rewards_add_the_final_score_only_when_asked():
    from lorarl.rewards.registry import RewardResult
    from lorarl.trainer.episodes.environment import Episode
    from lorarl.trainer.generation.types import Sample

    def ep(reward: float, reply: str) -> Episode:
        s = Sample([1], [5], [-0.1], "stop", 0, "e", loss_mask=(1,))
        return Episode(s, reward, reply, 1, "done")

    groups = [[ep(0.5, "b"), ep(0.0, "x")]]
    seen = []

    def scorer(prompts, completions, truths, metas):
        seen.append((prompts, completions, truths))
        return [RewardResult(float(c == t)) for c, t in zip(completions, truths, strict=True)]

    items = [PromptItem("after a", answer="b")]
    assert episode_rewards(items, groups, None, str) == [0.5, 0.0]
    assert episode_rewards(items, groups, scorer, str) == [1.5, 0.0]
    assert seen == [(["after a", "after a"], ["b", "x"], ["b", "b"])]


def test_busy_seconds_counts_overlaps_once():
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)
    assert busy_seconds([(0, 10), (2, 3)]) == pytest.approx(10.0)


def test_turn_tokens_match_the_template_on_smollm2():
    """On ChatML the appended tokens are exactly what rendering the whole conversation gives
    (the model's own <|im_end|> is not added twice)."""
    from harness.workloads.pretrained import smollm2

    tok = AutoTokenizer.from_pretrained(smollm2())
    tt = TurnTokens(tok)
    user = [{"role": "user", "content": "What is 12*34?"}]
    reply = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    model = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    tool = [{"role": "tool", "content": "<tool_response>\n408\n</tool_response>"}]
    ids = tt.prompt(user) + model + tt.after_turn(model, tool)
    whole = tok.apply_chat_template(
        [*user, {"role": "assistant", "content": reply}, *tool],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert ids == tok(whole, add_special_tokens=False)["input_ids"]
    # A reply stopped by a stop string (no <|im_end|>) gets the whole end of turn appended.
    cut = model[:-1]
    assert tt.after_turn(cut, tool) == [tok.eos_token_id, *tt.after_turn(model, tool)]


def test_turn_tokens_need_a_chat_template(tmp_path: Path):
    from harness.workloads.tiny_models import make_tokenizer
    from lorarl.trainer.data.prompts import DataError

    tok = make_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="chat template"):
        TurnTokens(tok)


def test_the_rollout_worker_trains_on_episodes(engine):
    """RolloutWorker with episodes: group advantages over episode rewards, masks and per-turn
    rewards carried into the train samples, the step's episode metrics."""
    from lorarl.rewards.registry import RewardResult
    from lorarl.trainer.data.prompts import DataPosition, PromptDataset, PromptSampler
    from lorarl.trainer.generation.rollouts import RolloutWorker

    run = runner(engine, LetterRelay)
    scored = []

    def scorer(prompts, completions, truths, metas):
        scored.append(completions)
        return [RewardResult(0.0) for _ in completions]

    def collect(turn_rewards: bool, final_reward: bool):
        worker = RolloutWorker(
            dataset=PromptDataset(ITEMS), sampler=PromptSampler(4, 2, seed=0, shuffle=False),
            tokenizer=run.turn_tokens.tokenizer, client=run.client, scorer=scorer,
            estimator="grpo", group_size=4, max_prompt_tokens=64,
            sampling=SamplingParams(max_tokens=4, seed=7), episodes=run,
            final_reward=final_reward, turn_rewards=turn_rewards,
        )  # fmt: skip
        return worker.collect(DataPosition(), 0, "base", step=1)

    got = collect(turn_rewards=True, final_reward=False)
    assert scored == []  # finalReward off: spec.reward is never called
    assert len(got.samples) == 8 and got.episode_stats is not None
    assert got.episode_stats["turns_mean"] > 1.5
    for s, r in zip(got.samples, got.rewards.tolist(), strict=True):
        assert s.loss_mask is not None and s.reward == r
        assert sum(v for _, v in s.turn_rewards or []) == r  # LetterRelay's only reward
    for g in range(2):  # advantages are centred per group of 4 episodes
        group = got.samples[4 * g : 4 * g + 4]
        assert abs(sum(s.advantage for s in group)) < 1e-5
    again = collect(turn_rewards=False, final_reward=True)
    assert all(s.turn_rewards is None for s in again.samples)
    assert len(scored) == 1 and len(scored[0]) == 8  # the last replies, scored once per round
