"""Two agents in one episode, both played by the policy being trained (a MATPO-style job in
miniature): a planner reads the user's question and writes a message to a sub-agent; the sub-agent
(the solver) answers that message in its own conversation, without seeing the original question;
the solver's reply is the episode's final answer and its reward trains both.

    spec:
      agent:
        entrypoint: examples/agents/planner_agent.py:run
        maxCalls: 2

Each role is named by the request's `model` ("planner", "solver"): the endpoint serves the same
policy whatever the name, records every call token-exactly, and each call becomes a training
sample with the episode's reward, so the planner learns to write messages the solver can answer
and the solver learns to answer them. The episode also reports two metrics of its own.
"""

from __future__ import annotations

import re

PLANNER = "You are a planner. Rewrite the user's question for your helper."
SOLVER = "You are a helper. Answer with just the number."


async def run(client, sample, ctx):
    question = sample.messages[-1]["content"]
    plan = await client.chat.completions.create(
        model="planner",
        messages=[{"role": "system", "content": PLANNER}, {"role": "user", "content": question}],
    )
    note = plan.choices[0].message.content or ""
    reply = await client.chat.completions.create(
        model="solver",
        messages=[{"role": "system", "content": SOLVER}, {"role": "user", "content": note}],
    )
    answer = reply.choices[0].message.content or ""
    numbers = re.findall(r"-?\d+", answer)
    right = bool(numbers) and numbers[-1] == str(sample.answer).strip()
    # The planner passed on what the solver needs: both numbers of the question.
    passed = all(n in note for n in re.findall(r"\d+", question))
    return {"reward": float(right), "planner_passed_numbers": float(passed)}
