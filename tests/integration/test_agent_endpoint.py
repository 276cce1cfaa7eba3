"""Agent episodes (spec.agent) against a real HTTP engine (the tiny HF engine) and the real
`openai` client library: the endpoint's answers parse as the SDK's types, every call is recorded
with the engine's own token ids and logprobs, failures drop their group and are counted."""

from __future__ import annotations

import asyncio
import json
import os

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness.engines.hf_engine_server import create_app, serve_in_thread
from harness.workloads import letter_agent
from harness.workloads.tiny_models import taught_letter_model
from lorarl.trainer.data.prompts import PromptItem
from lorarl.trainer.episodes.agents import AgentRunner
from lorarl.trainer.episodes.endpoint import AgentEndpoint, EpisodeCalls, serve
from lorarl.trainer.generation.client import RolloutClient, RolloutError
from lorarl.trainer.generation.rollouts import _train_sample
from lorarl.trainer.generation.types import Sample, SamplingParams
from lorarl.trainer.model.logprobs import sequence_logprobs
from lorarl.trainer.update.batch import collate

ITEMS = [PromptItem(f"after {c}", answer=chr(ord(c) + 1)) for c in "abcd"]
PARAMS = SamplingParams(max_tokens=4, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = taught_letter_model(tmp_path_factory.mktemp("m") / "tiny", "abcdefgh", steps=60)
    url, stop = serve_in_thread(create_app(model_dir, served_model_name="base"))
    yield model_dir, url
    stop()


def runner(engine, agent, **overrides) -> AgentRunner:
    model_dir, url = engine
    settings = dict(max_concurrency=3, timeout_s=60.0, max_turns=4, max_prompt_tokens=64,
                    max_response_tokens=4)  # fmt: skip
    settings.update(overrides)
    return AgentRunner(
        client=RolloutClient([url], "vllm", model_name="base"),
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        agent=agent,
        **settings,
    )


def test_openai_sdk_agent_calls_are_recorded_token_exact(engine):
    model_dir, _ = engine
    run = runner(engine, letter_agent.run)
    groups = run.run(ITEMS, 2, PARAMS, model="base", version=0, seed=5)
    assert run.failures == [] and [len(g) for g in groups] == [2, 2, 2, 2]
    tok = run.tokenizer
    episodes = [e for g in groups for e in g]
    for item, group in zip(ITEMS, groups, strict=True):
        for episode in group:
            [call] = episode.calls
            assert set(episode.metrics) == {"replied"} and episode.reward in (0.0, 1.0)
            rendered = tok.apply_chat_template(
                [{"role": "user", "content": item.prompt}], tokenize=False,
                add_generation_prompt=True,
            )  # fmt: skip
            assert call.prompt_ids == tok(rendered, add_special_tokens=False)["input_ids"]
            assert 1 <= len(call.completion_ids) <= 4 and call.weight_version == 0
    # The engine's own tokens: the trainer's logprobs of the recorded ids are the engine's.
    samples = [_train_sample(c, 0.0, e.reward) for e in episodes for c in e.calls]
    batch = collate(samples, tok.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp, _ = sequence_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.response_mask, micro_batch_size=8
        )
    scored = batch.response_mask.bool()
    gap = (lp - batch.rollout_logprobs).abs()[scored]
    assert gap.max().item() < 1e-4, gap.max()


def test_each_call_of_an_episode_is_recorded_and_seeded_apart(engine):
    run = runner(engine, letter_agent.two_calls)
    groups = run.run(ITEMS[:2], 2, PARAMS, model="base", version=0, seed=5)
    for group in groups:
        for episode in group:
            first, second = episode.calls
            # the second call's prompt holds the first reply, re-rendered by the template
            assert len(second.prompt_ids) > len(first.prompt_ids)
    again = run.run(ITEMS[:2], 2, PARAMS, model="base", version=0, seed=5)
    ids = [[c.completion_ids for c in e.calls] for g in groups for e in g]
    assert ids == [[c.completion_ids for c in e.calls] for g in again for e in g]


def test_a_failed_episode_drops_its_group_and_is_counted(engine):
    run = runner(engine, letter_agent.broken)
    groups = run.run(ITEMS[:2], 2, PARAMS, model="base", version=0, seed=5)
    assert groups == [[], []]  # episode 1 and 3 raised: both groups dropped
    assert len(run.failures) == 2 and "fell over" in run.failures[0]


def test_timeouts_no_calls_and_bad_returns_fail_the_episode(engine):
    async def slow(client, sample, ctx):
        await asyncio.sleep(5)

    async def silent(client, sample, ctx):
        return 1.0

    async def bad(client, sample, ctx):
        await letter_agent.run(client, sample, ctx)
        return "yes"

    for agent, why in ((slow, "timed out"), (silent, "no model call"), (bad, "not a finite")):
        run = runner(engine, agent, timeout_s=0.5)
        assert run.run(ITEMS[:1], 1, PARAMS, model="base", version=0, seed=0) == [[]]
        assert why in run.failures[0], run.failures


def test_keys_are_required_and_calls_are_bounded(engine):
    _, url = engine
    model_dir, _ = engine

    async def go():
        client = RolloutClient([url], "vllm", model_name="base")
        endpoint = AgentEndpoint(
            client, AutoTokenizer.from_pretrained(model_dir), max_prompt_tokens=64,
            max_response_tokens=4,
        )  # fmt: skip
        calls = EpisodeCalls(PARAMS, "base", 0, max_calls=1, seed_base=7)
        key = endpoint.open(calls)
        messages = [{"role": "user", "content": "after a"}]
        async with client, serve(endpoint.app) as server:
            wrong = openai.AsyncOpenAI(base_url=server.base_url, api_key="nope", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model="m", messages=messages)
            sdk = openai.AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0)
            models = await sdk.models.list()
            assert [m.id for m in models.data] == ["policy"]
            reply = await sdk.chat.completions.create(model="m", messages=messages)
            assert reply.usage.completion_tokens == len(calls.calls[0].completion_ids)
            with pytest.raises(openai.RateLimitError):  # agent.maxCalls
                await sdk.chat.completions.create(model="m", messages=messages)
            endpoint.close(key)
            with pytest.raises(openai.AuthenticationError):  # a finished episode's key
                await sdk.chat.completions.create(model="m", messages=messages)
            await wrong.close()
            await sdk.close()
        return reply

    reply = asyncio.run(go())
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")


class ScriptedClient:
    """Stands in for RolloutClient where the model's text must be a tool call the tiny model
    would not write: answers each call with the next scripted completion."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    async def agenerate(self, prompts, n, params, *, model, expected_version):
        self.prompts.append(list(prompts[0]))
        ids = self.tokenizer(self.replies.pop(0), add_special_tokens=False)["input_ids"]
        sample = Sample(list(prompts[0]), ids, [-0.5] * len(ids), "stop", expected_version, "x")
        return [[sample]]


@pytest.mark.parametrize("entry", ["run", "run_with_server"])
def test_tool_calls_come_back_in_the_openai_format_and_go_back_through_the_template(engine, entry):
    """`run` computes in process; `run_with_server` asks its tool server, a process of its own
    started beside the agent (the result reaches the model the same way)."""
    from examples.agents import calculator_agent

    model_dir, _ = engine
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TOOL_TEMPLATE  # the tiny model's template has no tools
    call = {"name": "calculator", "arguments": {"expression": "6*7"}}
    scripted = ScriptedClient(
        tok, [f"let me compute <tool_call>\n{json.dumps(call)}\n</tool_call>", "it is 42"]
    )
    endpoint = AgentEndpoint(scripted, tok, max_prompt_tokens=4096, max_response_tokens=64)
    calls = EpisodeCalls(PARAMS, "base", 0, max_calls=4, seed_base=None)
    key = endpoint.open(calls)
    sample = type("S", (), {"messages": [{"role": "user", "content": "6 times 7?"}],
                            "answer": "42"})()  # fmt: skip
    ctx = type("C", (), {"model": "m"})()

    async def go():
        async with serve(endpoint.app) as server:
            sdk = openai.AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0)
            try:
                return await getattr(calculator_agent, entry)(sdk, sample, ctx)
            finally:
                await sdk.close()

    result = asyncio.run(go())
    server = calculator_agent._server
    if entry == "run_with_server":
        assert server is not None and server.poll() is None and server.pid != os.getpid()
        assert server.stdin is not None
        server.stdin.close()  # the trainer process ending: the server goes with it
        assert server.wait(timeout=10) == 0
    assert result == {"reward": 1.0, "tool_rounds": 1.0}  # one reply called the tool
    assert len(calls.calls) == 2
    # the second prompt holds the tool call (arguments as an object) and the tool's answer
    first, second = (tok.decode(p) for p in scripted.prompts)
    assert first.startswith('<tools>[{"type": "function"') and "6 times 7?" in first
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}' in second
    assert second.endswith("tool: 42assistant: "), second


# ChatML-like, with Qwen's handling of tools (declared up front) and of an assistant's tool calls
# (their arguments written as a JSON object)
TOOL_TEMPLATE = (
    "{%- if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{%- for m in messages %}{{ m.role }}: {{ m.content }}"
    '{%- for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}\n'
    "{%- endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_an_engine_failure_fails_the_step_not_the_episode(engine):
    run = runner(engine, letter_agent.run)
    # nothing listens here: the client's retries run out and the step must fail loudly
    run.client = RolloutClient(["http://127.0.0.1:9"], "vllm", model_name="base", max_retries=0)
    with pytest.raises(RolloutError):
        run.run(ITEMS[:1], 1, PARAMS, model="base", version=0, seed=0)
