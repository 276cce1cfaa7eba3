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


AGENT_CM = {"name": "my-agent", "mountPath": "/agents"}
OUTPUTS = {"outputDir": "/out/a", "volume": {"claimName": "out", "mountPath": "/out"}}


@pytest.mark.parametrize(
    "agent, cluster, words",
    [
        ({"entrypoint": "/agents/a.py:run", "configMap": AGENT_CM}, True, None),
        ({"entrypoint": "/elsewhere/a.py:run", "configMap": AGENT_CM}, True, "under its mountPath"),
        ({"entrypoint": "agents/a.py:run"}, False, None),  # relative: for a local run
        ({"entrypoint": "agents/a.py:run"}, True, "absolute path"),
        ({"entrypoint": "mypkg.agents:run"}, True, None),
    ],
)  # fmt: skip
def test_an_agent_file_in_a_cluster_comes_from_its_config_map(agent, cluster, words):
    from lorarl.api.rules import CLUSTER

    doc = {**BASE, "spec": {**BASE["spec"], "agent": agent, "training": OUTPUTS}}
    if words is None:
        LoRARLJob.model_validate(doc, context=CLUSTER if cluster else None)
    else:
        with pytest.raises(ValidationError, match=words):
            LoRARLJob.model_validate(doc, context=CLUSTER if cluster else None)


def test_the_agent_config_map_needs_its_own_mount_path():
    from lorarl.api.rules import CLUSTER

    cm = {"name": "my-agent", "mountPath": "/out"}
    agent = {"entrypoint": "/out/a.py:run", "configMap": cm}
    doc = {**BASE, "spec": {**BASE["spec"], "agent": agent, "training": OUTPUTS}}
    with pytest.raises(
        ValidationError, match=r"agent\.configMap and rollout\.cacheVolume need distinct"
    ):
        LoRARLJob.model_validate(doc, context=CLUSTER)


def test_the_agent_config_map_is_mounted_in_the_trainer_pods_only():
    import kubernetes_validate

    from lorarl.api.validation import parse_job
    from lorarl.operator import builders
    from lorarl.plan import plan

    agent = {"entrypoint": "/agents/a.py:run", "configMap": AGENT_CM}
    doc = {**BASE, "spec": {**BASE["spec"], "agent": agent, "training": OUTPUTS}}
    j = parse_job(doc)
    p = plan(j)
    volume = {"name": "agent-code", "configMap": {"name": "my-agent"}}
    mount = {"name": "agent-code", "mountPath": "/agents", "readOnly": True}
    for role in ("trainer", "rollout"):
        pod = builders.pod(p, j, role, 0)
        kubernetes_validate.validate(pod, "1.34", strict=True)
        spec = pod["spec"]
        trains = role == "trainer"
        assert (volume in spec["volumes"]) is trains, role
        mounted = [c["name"] for c in spec["containers"] if mount in c["volumeMounts"]]
        assert mounted == (["trainer"] if trains else []), role
