"""The agent endpoint's calls without an engine: /v1/completions (text and token ids), streaming as
OpenAI's server-sent chunks, and prefix-merge of an episode's calls (agent.trajectory: merged)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from lorarl.api.resource import LoRARLJob
from lorarl.local.tiny import make_tokenizer
from lorarl.trainer.data.prompts import PromptItem
from lorarl.trainer.episodes.agents import AgentRunner, build_agent_runner, merge_calls
from lorarl.trainer.episodes.endpoint import AgentEndpoint, EpisodeCalls
from lorarl.trainer.generation.types import Sample, SamplingParams

PARAMS = SamplingParams(max_tokens=8, seed=1)
TOK = make_tokenizer()


class Scripted:
    """Stands in for RolloutClient: each call answers with the next scripted text."""

    def __init__(self, *replies: str) -> None:
        self.replies, self.prompts = list(replies), []

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def agenerate(self, prompts, n, params, *, model, expected_version):
        self.prompts.append((list(prompts[0]), params))
        ids = TOK(self.replies.pop(0), add_special_tokens=False)["input_ids"]
        lps = [-0.1 * (i + 1) for i in range(len(ids))]
        return [[Sample(list(prompts[0]), ids, lps, "stop", expected_version, "e")]]


def post(endpoint: AgentEndpoint, path: str, body: dict, key: str) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=endpoint.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post(path, json=body, headers={"Authorization": f"Bearer {key}"})

    return asyncio.run(go())


def setup(*replies: str, max_prompt: int = 64) -> tuple[AgentEndpoint, EpisodeCalls, str, Scripted]:
    client = Scripted(*replies)
    endpoint = AgentEndpoint(client, TOK, max_prompt_tokens=max_prompt, max_response_tokens=6)
    calls = EpisodeCalls(PARAMS, "base", 3, max_calls=4, seed_base=10)
    return endpoint, calls, endpoint.open(calls), client


def events(resp: httpx.Response) -> list:
    assert resp.headers["content-type"].startswith("text/event-stream")
    data = [line[len("data: ") :] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completions_take_text_or_token_ids_and_record_the_call():
    endpoint, calls, key, client = setup("bc", "de")
    text = post(endpoint, "/v1/completions", {"prompt": "after a", "max_tokens": 3}, key).json()
    ids = TOK("xy", add_special_tokens=False)["input_ids"]
    body = {"prompt": [ids], "logprobs": 1, "return_token_ids": True}
    by_ids = post(endpoint, "/v1/completions", body, key).json()
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "bc"
    assert by_ids["choices"][0]["text"] == "de"
    first, second = calls.calls
    assert first.prompt_ids == TOK("after a")["input_ids"] and second.prompt_ids == ids
    assert [p.max_tokens for _, p in client.prompts] == [3, 6]  # capped by maxResponseTokens
    assert [p.seed for _, p in client.prompts] == [10, 11]  # the episode's block of seeds
    lp = by_ids["choices"][0]["logprobs"]
    assert lp["tokens"] == ["d", "e"] and lp["token_logprobs"] == second.logprobs
    assert lp["text_offset"] == [0, 1]
    assert by_ids["choices"][0]["token_ids"] == second.completion_ids  # vLLM's return_token_ids
    assert by_ids["choices"][0]["prompt_token_ids"] == ids and "token_ids" not in text["choices"][0]
    assert text["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}


@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt": ""}, "non-empty string"),
        ({"prompt": ["a", "b"]}, "one non-empty string"),
        ({"prompt": [1, -2]}, "token ids"),
        ({"prompt": "a", "n": 2}, "n must be 1"),
        ({"prompt": "a", "echo": True}, "echo"),
    ],
)
def test_completions_refuse_what_is_not_one_sample(body, words):
    endpoint, calls, key, _ = setup("x")
    resp = post(endpoint, "/v1/completions", body, key)
    assert resp.status_code == 400 and words in resp.json()["error"]["message"]
    assert calls.calls == [] and calls.requested == 0  # a refused call uses no seed


def test_a_wrong_key_is_refused_on_completions():
    endpoint, _, _, _ = setup()
    resp = post(endpoint, "/v1/completions", {"prompt": "a"}, "nope")
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


def test_chat_streams_openai_chunks_with_tool_calls_and_usage():
    call = '{"name": "calc", "arguments": {"x": 1}}'
    endpoint, calls, key, _ = setup(f"hm <tool_call>{call}</tool_call>", max_prompt=1024)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    body = {"messages": [{"role": "user", "content": "q"}], "tools": tools, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True}  # fmt: skip
    chunks = events(post(endpoint, "/v1/chat/completions", body, key))
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "hm"}
    [tool] = deltas[2]["tool_calls"]
    assert tool["index"] == 0 and tool["function"]["name"] == "calc"
    assert json.loads(tool["function"]["arguments"]) == {"x": 1}
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(
        calls.calls[0].completion_ids
    )
    assert len(chunks[1]["choices"][0]["logprobs"]["content"]) == len(calls.calls[0].logprobs)


def test_completions_stream_and_tool_choice_none_keeps_the_text():
    endpoint, calls, key, _ = setup("abc", "<tool_call>{}</tool_call>")
    chunks = events(post(endpoint, "/v1/completions", {"prompt": "p", "stream": True}, key))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]
    body = {"messages": [{"role": "user", "content": "q"}], "tools": [], "tool_choice": "none"}
    reply = post(endpoint, "/v1/chat/completions", body, key).json()
    assert reply["choices"][0]["message"]["content"] == "<tool_call>{}</tool_call>"
    assert len(calls.calls) == 2  # streamed or not, every call is recorded


def sample(prompt, completion, mask=None) -> Sample:
    lps = [-1.0] * len(completion)
    return Sample(prompt, completion, lps, "stop", 2, "e", loss_mask=mask)


def test_merge_joins_calls_that_extend_one_conversation():
    a = sample([1, 2], [3, 4])
    b = sample([1, 2, 3, 4, 9, 9], [5])
    c = sample([1, 2, 3, 4, 9, 9, 5], [6, 7])  # nothing between the replies
    merged = merge_calls([a, b, c])
    assert merged is not None and merged.prompt_ids == [1, 2]
    assert merged.completion_ids == [3, 4, 9, 9, 5, 6, 7]
    assert merged.loss_mask == (1, 1, 0, 0, 1, 1, 1)
    assert merged.logprobs == [-1.0, -1.0, 0.0, 0.0, -1.0, -1.0, -1.0]
    assert merge_calls([a]) == a and merge_calls([]) is None


@pytest.mark.parametrize(
    "second",
    [
        [1, 2, 3, 5, 9],  # the first reply re-tokenised differently
        [1, 7, 3, 4, 9],  # another first prompt
        [1, 2, 3],  # shorter than what it should extend
    ],
)
def test_merge_refuses_calls_that_do_not_match_token_for_token(second):
    assert merge_calls([sample([1, 2], [3, 4]), sample(second, [8])]) is None


def test_the_runner_merges_when_asked_and_falls_back_per_call():
    async def agent(client, item, ctx):  # completions on token ids: one conversation
        ids = TOK("q:", add_special_tokens=False)["input_ids"]
        extra = {"return_token_ids": True}
        first = await client.completions.create(model=ctx.model, prompt=ids, extra_body=extra)
        ids += first.choices[0].token_ids + TOK("!", add_special_tokens=False)["input_ids"]
        await client.completions.create(model=ctx.model, prompt=ids)
        return 1.0

    async def chat(client, item, ctx):  # a string prompt that drops the first reply
        await client.completions.create(model=ctx.model, prompt="q:")
        await client.completions.create(model=ctx.model, prompt="r:")
        return 0.5

    def run(fn, merge):
        runner = AgentRunner(
            client=Scripted("ab", "cd"), tokenizer=TOK, agent=fn, max_concurrency=1,
            timeout_s=10, max_turns=4, max_prompt_tokens=64, max_response_tokens=6, merge=merge,
        )  # fmt: skip
        [[episode]] = runner.run([PromptItem("x")], 1, PARAMS, model="base", version=2, seed=0)
        assert runner.failures == []
        return episode.calls

    [merged] = run(agent, True)
    assert TOK.decode(merged.prompt_ids) == "q:" and TOK.decode(merged.completion_ids) == "ab!cd"
    assert merged.loss_mask == (1, 1, 0, 1, 1)
    assert len(run(agent, False)) == 2 and len(run(chat, True)) == 2


def test_the_trajectory_field_selects_merging():
    base = {"apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob", "metadata": {"name": "a"},
            "spec": {"model": {"path": "/m"}, "data": {"trainFiles": ["t.jsonl"]}}}  # fmt: skip

    def job(**agent) -> LoRARLJob:
        spec = {**base["spec"], "agent": {"entrypoint": "asyncio:sleep", **agent}}
        return LoRARLJob.model_validate({**base, "spec": spec})

    assert job().spec.agent.trajectory == "perCall"
    assert build_agent_runner(job(), None, None).merge is False
    assert build_agent_runner(job(trajectory="merged"), None, None).merge is True
    with pytest.raises(ValueError):
        job(trajectory="both")
