"""Agent episodes with several roles and ppo's call rewards: a call's role is the `model` its
request names (agent.excludeRoles leaves a role out of training), a template without tool support
gets the tools in the Hermes format, and call_rewards shape what each sample is trained toward."""

from __future__ import annotations

import json

import pytest

from lorarl.trainer.data.prompts import PromptItem
from lorarl.trainer.episodes.agents import AgentEpisode, AgentRunner, merge_calls
from lorarl.trainer.episodes.endpoint import EpisodeCalls

from .test_agent_endpoint_calls import PARAMS, TOK, Scripted, post, sample, setup


def test_calls_are_kept_in_request_order_with_their_roles():
    calls = EpisodeCalls(PARAMS, "base", 3, max_calls=4, seed_base=None)
    a, b, c = sample([1], [2]), sample([1], [3]), sample([1], [4])
    calls.record(2, c, "sub")  # concurrent calls finish in any order
    calls.record(0, a, "planner")
    calls.record(1, b, "sub")
    assert calls.calls == [a, b, c] and calls.roles == ["planner", "sub", "sub"]


def test_a_template_without_tools_gets_them_as_hermes_text():
    call = '{"name": "calc", "arguments": {"x": 1}}'
    endpoint, calls, key, client = setup(f"hm <tool_call>{call}</tool_call>", "2", "3",
                                         max_prompt=2048)  # fmt: skip
    assert not endpoint.template_tools  # the test tokenizer's template has no `tools`
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    question = [{"role": "user", "content": "q"}]
    body = {"model": "planner", "messages": question, "tools": tools}
    reply = post(endpoint, "/v1/chat/completions", body, key).json()
    message = reply["choices"][0]["message"]
    assert message["content"] == "hm" and message["tool_calls"][0]["function"]["name"] == "calc"
    first = TOK.decode(client.prompts[0][0])
    assert first.startswith("system: You can call tools") and json.dumps(tools[0]) in first
    # The agent passes the reply back as the SDK gives it: the model's own text is re-rendered
    result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "1"}
    again = [*question, message, result]
    post(endpoint, "/v1/chat/completions", {"model": "sub", "messages": again, "tools": tools}, key)
    second = TOK.decode(client.prompts[1][0])
    assert f"assistant: hm <tool_call>{call}</tool_call>\n" in second
    assert "tool: <tool_response>\n1\n</tool_response>\n" in second
    # An unknown call id is written as a <tool_call> block; a <tools> block of the agent's own
    # replaces the endpoint's system text.
    foreign = {
        **message,
        "content": None,
        "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "calc", "arguments": '{"x": 2}'}}
        ],
    }
    own = [{"role": "system", "content": "mine <tools>calc</tools>"}, *question, foreign]
    post(endpoint, "/v1/chat/completions", {"messages": own, "tools": tools}, key)
    third = TOK.decode(client.prompts[2][0])
    assert third.startswith("system: mine <tools>calc</tools>\n") and "You can call" not in third
    assert 'assistant: <tool_call>\n{"name": "calc", "arguments": {"x": 2}}\n</tool_call>' in third
    assert calls.roles == ["planner", "sub", ""]


def runner(agent, *replies, **options) -> AgentRunner:
    return AgentRunner(
        client=Scripted(*replies), tokenizer=TOK, agent=agent, max_concurrency=1, timeout_s=10,
        max_turns=4, max_prompt_tokens=64, max_response_tokens=6, **options,
    )  # fmt: skip


def one(r: AgentRunner) -> AgentEpisode | None:
    [group] = r.run([PromptItem("x")], 1, PARAMS, model="base", version=2, seed=0)
    return group[0] if group else None


async def planner_and_sub(client, item, ctx):
    """A planner asks a sub-agent (its own conversation), then answers from its reply."""
    plan = await client.completions.create(model="planner", prompt="q:")
    await client.completions.create(model="sub", prompt="s:" + plan.choices[0].text)
    await client.completions.create(model="planner", prompt="q:" + plan.choices[0].text + "!")
    return {"reward": 1.0, "call_rewards": [0.25, 0.5, 0.0]}


def test_an_excluded_role_is_not_trained_but_counts_as_a_call():
    kept = one(runner(planner_and_sub, "ab", "cd", "ef", exclude_roles=frozenset({"sub"}),
                      call_rewards=True))  # fmt: skip
    assert kept is not None and kept.n_calls == 3 and kept.generated == 6
    assert [TOK.decode(c.completion_ids) for c in kept.calls] == ["ab", "ef"]
    # ppo, per call: each call is trained toward what the episode earned from it on
    assert kept.returns == [1.0, 0.25]
    every = one(runner(planner_and_sub, "ab", "cd", "ef", call_rewards=True))
    assert every is not None and every.returns == [1.0, 0.75, 0.25]


async def one_conversation(client, item, ctx):
    ids = TOK("q:", add_special_tokens=False)["input_ids"]
    extra = {"return_token_ids": True}
    first = await client.completions.create(model="sub", prompt=ids, extra_body=extra)
    ids += first.choices[0].token_ids + TOK("!", add_special_tokens=False)["input_ids"]
    await client.completions.create(model="planner", prompt=ids)
    return {"reward": 2.0, "call_rewards": [0.5, 0.25], "tools": 1}


def test_merged_masks_an_excluded_role_and_puts_call_rewards_on_their_tokens():
    episode = one(runner(one_conversation, "ab", "cd", merge=True,
                         exclude_roles=frozenset({"sub"}), call_rewards=True))  # fmt: skip
    assert episode is not None and episode.n_calls == 2 and episode.metrics == {"tools": 1.0}
    [merged] = episode.calls
    assert TOK.decode(merged.completion_ids) == "ab!cd"
    assert merged.loss_mask == (0, 0, 0, 1, 1)  # the sub-agent's "ab" is not trained
    assert merged.turn_rewards == ((1, 0.5), (4, 0.25)) and episode.returns == [2.0]


def test_merge_without_options_is_unchanged():
    a, b = sample([1, 2], [3, 4]), sample([1, 2, 3, 4, 9], [5])
    merged = merge_calls([a, b])
    assert merged is not None and merged.turn_rewards is None
    assert merged.loss_mask == (1, 1, 0, 1)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"call_rewards": True, "exclude_roles": frozenset({"sub", "planner"})},
         "every call of the episode"),
        ({}, "call_rewards need algorithm.name: ppo"),
        ({"call_rewards": True, "merge": True, "exclude_roles": frozenset({"sub", "planner"})},
         "every call of the episode"),
    ],
)  # fmt: skip
def test_what_fails_an_episode(options, words):
    r = runner(planner_and_sub, "ab", "cd", "ef", **options)
    assert one(r) is None and len(r.failures) == 1 and words in r.failures[0]


def test_call_rewards_must_be_one_number_per_call():
    async def short(client, item, ctx):
        await client.completions.create(model="a", prompt="q:")
        return {"reward": 1.0, "call_rewards": [0.1, 0.2]}

    r = runner(short, "ab", call_rewards=True)
    assert one(r) is None and "2 rewards for the episode's 1 recorded calls" in r.failures[0]


def test_the_rollout_worker_trains_ppo_on_the_agents_call_rewards():
    from lorarl.trainer.data.prompts import DataPosition, PromptDataset, PromptSampler
    from lorarl.trainer.generation.rollouts import RolloutWorker
    from lorarl.trainer.update.batch import collate

    agents = runner(one_conversation, "ab", "cd", merge=True, exclude_roles=frozenset({"sub"}),
                    call_rewards=True)  # fmt: skip
    worker = RolloutWorker(
        dataset=PromptDataset.from_rows([{"prompt": "a", "answer": "x"}], "prompt", "answer"),
        sampler=PromptSampler(1, 1, seed=0, shuffle=False), tokenizer=TOK, client=None,
        scorer=None, estimator="ppo", group_size=1, max_prompt_tokens=64, sampling=PARAMS,
        agents=agents,
    )  # fmt: skip
    got = worker.collect(DataPosition(), 2, "base")
    [s] = got.samples
    assert s.reward == 2.0 and s.turn_rewards == [(1, 0.5), (4, 0.25)]
    assert got.episode_stats == {"turns_mean": 2.0, "failed_episodes": 0}
    assert got.generated_tokens == 4  # "ab" and "cd": the engines' tokens, not the "!"
    batch = collate(got.samples, pad_id=0)
    # the trained call's reward on its last token; the excluded call's joins the rest (2.0 -
    # 0.25) on the last token: ppo_token_rewards
    assert batch.turn_rewards is not None and batch.turn_rewards.sum().item() == 0.25
    assert batch.response_mask.sum().item() == 2.0  # the excluded sub-agent's reply is masked


def flaky(fails: int):
    """An agent whose first `fails` tries raise after one model call (a tool server's hiccup)."""
    tries = []

    async def run(client, item, ctx):
        tries.append(ctx.api_key)
        await client.completions.create(model="m", prompt="q:")
        if len(tries) <= fails:
            raise ConnectionError("tool server unreachable")
        return {"reward": 1.0, "tries": float(len(tries))}

    return run, tries


def test_a_failed_episode_is_tried_again_with_a_fresh_key_and_record():
    agent, tries = flaky(1)
    r = runner(agent, "ab", "cd", retries=1)
    episode = one(r)
    assert episode is not None and r.failures == [] and r.retried == 1
    assert len(tries) == 2 and tries[0] != tries[1]  # each try its own key
    # only the successful try's call is trained: the failed one's record is dropped
    assert episode.n_calls == 1 and [TOK.decode(c.completion_ids) for c in episode.calls] == ["cd"]
    assert episode.metrics == {"tries": 2.0}


def test_an_episode_fails_when_its_last_try_does():
    agent, tries = flaky(3)
    r = runner(agent, "ab", "cd", "ef", retries=2)
    assert one(r) is None and len(tries) == 3 and r.retried == 2
    assert r.failures == ["episode 0 (after 3 tries): ConnectionError('tool server unreachable')"]
    agent, tries = flaky(1)
    r = runner(agent, "ab", "cd")  # retries: 0, the default
    assert one(r) is None and len(tries) == 1 and r.retried == 0 and len(r.failures) == 1
