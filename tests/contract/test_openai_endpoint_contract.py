"""The agent endpoint (spec.agent) against the `openai` client library's own request and response
types: chat with tools (tool_calls parsed by the SDK into its types), completions from text and
from token ids, streaming of both, and a wrong key refused.

Backed by a real endpoint over a real `RolloutClient` and the test engine
(harness/engines/hf_engine_server.py: vLLM's HTTP wire format over a tiny model); where the
model's text must be a tool call the tiny model would not write, the engine's sampler is
scripted, the wire stays real.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall
from openai.types.completion import Completion as SdkCompletion
from transformers import AutoTokenizer

from harness.engines.hf_engine_server import Completion, create_app, serve_in_thread
from harness.workloads.tiny_models import make_tiny_model
from lorarl.trainer.episodes.endpoint import AgentEndpoint, EpisodeCalls, serve
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.types import SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
# ChatML-like with Qwen's handling of tools, as the tiny model's own template has none
TOOL_TEMPLATE = (
    "{%- if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{%- for m in messages %}{{ m.role }}: {{ m.content }}"
    '{%- for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}\n'
    "{%- endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass
class Stack:
    endpoint: AgentEndpoint
    tokenizer: object
    url: str
    script: list[str]  # the engine's next completions (texts), else it samples for real


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", "llama", init_std=0.1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TOOL_TEMPLATE
    app = create_app(model_dir, served_model_name="base")
    engine, script = app.state.engine, []
    real = engine.sample

    def sample(prompt, n, max_tokens, *args, **kwargs):
        if not script:
            return real(prompt, n, max_tokens, *args, **kwargs)
        ids = tok(script.pop(0), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return [Completion(ids, [-0.25] * len(ids), [], "stop", None) for _ in range(n)]

    engine.sample = sample
    url, stop = serve_in_thread(app)
    endpoint = AgentEndpoint(
        RolloutClient([url], "vllm", model_name="base"), tok, max_prompt_tokens=1024,
        max_response_tokens=64,
    )  # fmt: skip
    yield Stack(endpoint, tok, url, script)
    stop()


def drive(stack: Stack, agent, max_calls: int = 8) -> tuple[object, EpisodeCalls]:
    """Run `agent(sdk)` against a served endpoint with a fresh episode's key."""
    calls = EpisodeCalls(PARAMS, "base", 0, max_calls=max_calls, seed_base=11)
    key = stack.endpoint.open(calls)

    async def go():
        async with stack.endpoint.client, serve(stack.endpoint.app) as server:
            sdk = openai.AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0)
            try:
                return await agent(sdk)
            finally:
                await sdk.close()
                stack.endpoint.close(key)

    return asyncio.run(go()), calls


def test_chat_with_tools_parses_into_the_sdks_types(stack):
    call = {"name": "calculator", "arguments": {"expression": "6*7"}}
    stack.script[:] = [f"sure <tool_call>\n{json.dumps(call)}\n</tool_call>", "it is 42"]
    question = [{"role": "user", "content": "6 times 7?"}]

    async def agent(sdk):
        first = await sdk.chat.completions.create(model="m", messages=question, tools=[CALC])
        msg = first.choices[0].message
        result = {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "42"}
        followup = [*question, msg.model_dump(exclude_none=True), result]
        second = await sdk.chat.completions.create(model="m", messages=followup, tools=[CALC])
        return first, second

    (first, second), calls = drive(stack, agent)
    assert isinstance(first, ChatCompletion) and first.choices[0].finish_reason == "tool_calls"
    msg = first.choices[0].message
    assert msg.role == "assistant" and msg.content == "sure"
    [call] = msg.tool_calls
    assert isinstance(call, ChatCompletionMessageToolCall) and call.type == "function"
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "6*7"}
    assert second.choices[0].message.content == "it is 42"
    assert second.choices[0].message.tool_calls is None
    # recorded token-in/token-out: the engine's ids, the tool call re-rendered by the template
    assert len(calls.calls) == 2
    assert first.usage.completion_tokens == len(calls.calls[0].completion_ids)
    second_prompt = stack.tokenizer.decode(calls.calls[1].prompt_ids)
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}' in second_prompt
    assert second_prompt.endswith("tool: 42assistant: ")


def test_completions_from_text_and_from_token_ids(stack):
    tok = stack.tokenizer
    stack.script[:] = []

    async def agent(sdk):
        text = await sdk.completions.create(model="m", prompt="after a", max_tokens=4)
        ids = tok("after b", add_special_tokens=False)["input_ids"]
        by_ids = await sdk.completions.create(
            model="m", prompt=ids, max_tokens=4, logprobs=1, extra_body={"return_token_ids": True}
        )
        return text, by_ids, ids

    (text, by_ids, ids), calls = drive(stack, agent)
    assert isinstance(text, SdkCompletion) and text.object == "text_completion"
    first, second = calls.calls
    assert first.prompt_ids == tok("after a")["input_ids"]  # vLLM's tokenization of a string
    assert second.prompt_ids == ids  # token ids go to the engine as they are
    for reply, call in ((text, first), (by_ids, second)):
        [choice] = reply.choices
        assert choice.finish_reason in ("stop", "length") and 1 <= len(call.completion_ids) <= 4
        assert choice.text == tok.decode(call.completion_ids, skip_special_tokens=True)
        assert reply.usage.prompt_tokens == len(call.prompt_ids)
    assert by_ids.choices[0].logprobs.token_logprobs == second.logprobs  # the engine's own
    assert by_ids.choices[0].token_ids == second.completion_ids  # vLLM's return_token_ids
    assert by_ids.choices[0].prompt_token_ids == ids


def test_streaming_chat_and_completions(stack):
    call = {"name": "calculator", "arguments": {"expression": "1+1"}}
    stack.script[:] = [f"ok <tool_call>\n{json.dumps(call)}\n</tool_call>", "two"]
    question = [{"role": "user", "content": "1+1?"}]

    async def agent(sdk):
        chat = [c async for c in await sdk.chat.completions.create(
            model="m", messages=question, tools=[CALC], stream=True,
            stream_options={"include_usage": True},
        )]  # fmt: skip
        text = [c async for c in await sdk.completions.create(model="m", prompt="x", stream=True)]
        return chat, text

    (chat, text), calls = drive(stack, agent)
    assert {c.object for c in chat} == {"chat.completion.chunk"}
    deltas = [c.choices[0].delta for c in chat if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "ok"
    [tool] = [t for d in deltas for t in d.tool_calls or []]
    assert tool.index == 0 and tool.function.name == "calculator"
    assert json.loads(tool.function.arguments) == {"expression": "1+1"}
    assert [c.choices[0].finish_reason for c in chat if c.choices][-1] == "tool_calls"
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == len(
        calls.calls[0].completion_ids
    )
    assert "".join(c.choices[0].text for c in text) == "two"
    assert text[-1].choices[0].finish_reason == "stop"
    assert len(calls.calls) == 2  # streamed calls are recorded as any other


def test_a_wrong_key_is_refused(stack):
    async def go():
        async with serve(stack.endpoint.app) as server:
            sdk = openai.AsyncOpenAI(base_url=server.base_url, api_key="nope", max_retries=0)
            try:
                with pytest.raises(openai.AuthenticationError) as chat:
                    await sdk.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}]
                    )
                with pytest.raises(openai.AuthenticationError) as text:
                    await sdk.completions.create(model="m", prompt="hi", stream=True)
            finally:
                await sdk.close()
        return chat.value, text.value

    chat, text = asyncio.run(go())
    assert chat.status_code == text.status_code == 401
    assert chat.code == "invalid_api_key"
