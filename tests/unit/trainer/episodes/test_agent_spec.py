"""spec.agent's admission: what it is exclusive with, and the entrypoint checked at start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lorarl.api.resource import LoRARLJob
from lorarl.trainer.episodes.agents import build_agent_runner
from lorarl.trainer.errors import ConfigError

BASE = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "a"},
    "spec": {"model": {"path": "/models/m"}, "data": {"trainFiles": ["t.jsonl"]}},
}


def job(**spec) -> LoRARLJob:
    return LoRARLJob.model_validate({**BASE, "spec": {**BASE["spec"], **spec}})


def test_defaults_and_a_file_entrypoint():
    agent = job(agent={"entrypoint": "agents/my_agent.py:run"}).spec.agent
    assert (agent.max_concurrency, agent.timeout_seconds, agent.max_calls) == (32, 300.0, 16)
    assert job().spec.agent is None


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"environment": {"entrypoint": "tool_calling"}}, "set one"),
        ({"reward": {"function": "exact_match"}}, "is not used"),
        ({"algorithm": {"name": "ppo"}}, "grpo, dr_grpo"),
        ({"algorithm": {"name": "dapo"}}, "grpo, dr_grpo"),
        ({"algorithm": {"dynamicSampling": {"enabled": True}}}, "dynamic sampling"),
        ({"algorithm": {"overlong": {"softPunishment": True}}}, "dynamic sampling"),
        ({"training": {"evalInterval": 5}, "data": {"trainFiles": ["t"], "valFiles": ["v"]}},
         "evals"),
    ],
)  # fmt: skip
def test_what_agent_refuses(extra, words):
    with pytest.raises(ValidationError, match=words):
        job(agent={"entrypoint": "mypkg.agents:run"}, **extra)


def test_the_agent_is_imported_at_start_and_must_be_async():
    ok = job(agent={"entrypoint": "harness.workloads.letter_agent:run"})
    runner = build_agent_runner(ok, tokenizer=None, client=None)
    assert runner is not None and runner.max_turns == 16
    with pytest.raises(ConfigError, match="async function"):
        build_agent_runner(job(agent={"entrypoint": "json:dumps"}), None, None)
    with pytest.raises(ConfigError, match="cannot import"):
        build_agent_runner(job(agent={"entrypoint": "no_such_pkg.x:run"}), None, None)
    assert build_agent_runner(job(), None, None) is None
