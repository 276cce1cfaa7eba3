"""Agent functions for the agent tests (spec.agent): the letter task through the openai SDK."""

from __future__ import annotations

import re


async def run(client, sample, ctx):
    """One call: the row's prompt as chat messages; reward 1 when the reply starts with the
    answer (as the letter task's regex reward would)."""
    reply = await client.chat.completions.create(
        model=ctx.model, messages=sample.messages, max_tokens=ctx.max_tokens
    )
    text = reply.choices[0].message.content or ""
    right = re.match(rf"^.{{0,3}}{sample.answer}", text) is not None
    return {"reward": float(right), "replied": float(bool(text.strip()))}


async def two_calls(client, sample, ctx):
    """Two calls of one episode: the second sees the first reply (each is its own sample)."""
    first = await client.chat.completions.create(model=ctx.model, messages=sample.messages)
    text = first.choices[0].message.content or ""
    messages = [*sample.messages, {"role": "assistant", "content": text},
                {"role": "user", "content": sample.prompt}]  # fmt: skip
    await client.chat.completions.create(model=ctx.model, messages=messages)
    return float(sample.answer in text)


async def broken(client, sample, ctx):
    if ctx.episode % 2:
        raise RuntimeError("the agent fell over")
    return await run(client, sample, ctx)


async def ppo_turns(client, sample, ctx):
    """Token-in/token-out, one conversation of two calls (a 'helper' role first, then the
    'answer' role), with ppo's call rewards: half a point for a first reply that names the
    answer, the rest of the reward for the final one. The first call is a chat (the prompt as
    the model was taught it: the raw text is a prompt it never saw, whose replies depend on the
    CPU's rounding); the second continues its exact tokens."""
    extra = {"return_token_ids": True}
    first = await client.chat.completions.create(
        model="helper", messages=sample.messages, extra_body=extra
    )
    ids = [*first.prompt_token_ids, *first.choices[0].token_ids]
    second = await client.completions.create(model="answer", prompt=ids, extra_body=extra)
    early = 0.5 * float(sample.answer in (first.choices[0].message.content or ""))
    right = re.match(rf"^.{{0,3}}{sample.answer}", second.choices[0].text) is not None
    return {"reward": early + float(right), "call_rewards": [early, 0.0]}
