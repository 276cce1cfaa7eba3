from __future__ import annotations

import copy

import pytest

from lorarl.api import RESERVED_ENV, LoRARLJob
from lorarl.plan import LocalAddressing, plan

BASE = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "job", "namespace": "ml"},
    "spec": {"model": {"path": "/models/m"}, "data": {"trainFiles": ["t.jsonl"]}},
}


def make(**spec) -> LoRARLJob:
    doc = copy.deepcopy(BASE)
    doc["spec"].update(spec)
    return LoRARLJob.model_validate(doc)


def env_of(p, role, i, container=0):
    return p.role(role).replicas[i].containers[container].env


def test_single_node_single_gpu():
    p = plan(make(trainer={"replicas": 1, "gpusPerReplica": 1}))
    env = env_of(p, "trainer", 0)
    assert (env["WORLD_SIZE"], env["NODE_RANK"], env["NPROC_PER_NODE"]) == ("1", "0", "1")
    assert env["MASTER_ADDR"] == "job-trainer-0.job"
    assert p.sync.backend == "gloo"  # the sidecar has no GPU: see test_sync_backend_...
    trainer = p.role("trainer").replicas[0].containers[0]
    assert trainer.resources.limits["nvidia.com/gpu"] == 1


def test_two_nodes_of_eight_gpus():
    p = plan(make(trainer={"replicas": 2, "gpusPerReplica": 8}, rollout={"replicas": 4}))
    replicas = p.role("trainer").replicas
    assert [r.name for r in replicas] == ["job-trainer-0", "job-trainer-1"]
    for i, r in enumerate(replicas):
        env = r.containers[0].env
        assert (env["WORLD_SIZE"], env["NODE_RANK"], env["NPROC_PER_NODE"]) == ("16", str(i), "8")
        assert env["MASTER_ADDR"] == "job-trainer-0.job"  # every node rendezvous at rank 0
        cmd = r.containers[0].command
        assert cmd[cmd.index("--node-rank") + 1] == str(i)
        assert cmd[cmd.index("--nnodes") + 1] == "2"
    assert (
        "sync" in replicas[0].containers[0].ports and "sync" not in replicas[1].containers[0].ports
    )


@pytest.mark.parametrize("n", [1, 3, 8])
def test_n_rollout_replicas_join_the_sync_group(n):
    p = plan(make(rollout={"replicas": n}))
    assert p.sync.world_size == n + 1
    rollouts = p.role("rollout").replicas
    assert len(rollouts) == n
    # A sidecar's env names its replica, never the replica count: scaling changes no pod.
    sidecars = [r.containers[1].env for r in rollouts]
    assert [e["LORARL_ROLLOUT_INDEX"] for e in sidecars] == [str(i) for i in range(n)]
    assert all("LORARL_SYNC_WORLD_SIZE" not in e for e in sidecars)
    assert [e["LORARL_ADVERTISED_ENGINE_URL"] for e in sidecars] == [
        f"http://job-rollout-{i}.job:30000" for i in range(n)
    ]
    assert [e["LORARL_ADVERTISED_SIDECAR_URL"] for e in sidecars] == [
        f"http://job-rollout-{i}.job:8001" for i in range(n)
    ]
    assert env_of(p, "trainer", 0)["LORARL_SYNC_WORLD_SIZE"] == str(n + 1)  # the start count
    endpoints = env_of(p, "trainer", 0)["LORARL_ROLLOUT_ENDPOINTS"].split(",")
    assert endpoints == [f"http://job-rollout-{i}.job:30000" for i in range(n)]
    for r in rollouts:
        assert [c.name for c in r.containers] == ["engine", "sidecar"]
        assert r.containers[1].env["LORARL_SYNC_ADDR"] == "job-trainer-0.job"


@pytest.mark.parametrize(("trainer_gpus", "rollout_gpus"), [(0, 0), (1, 1), (8, 2), (0, 1)])
def test_sync_backend_is_decided_once_and_both_ends_get_it(trainer_gpus, rollout_gpus):
    """gloo whatever the trainer runs on: the sidecar container gets no GPU, so an NCCL group
    (which the trainer alone would pick on GPUs) could never form. Both ends read the plan's
    choice from LORARL_SYNC_BACKEND instead of guessing from their own hardware."""
    p = plan(
        make(
            trainer={"gpusPerReplica": trainer_gpus},
            rollout={
                "gpusPerReplica": rollout_gpus,
                "tensorParallelSize": max(1, rollout_gpus),
                "engine": "vllm",
            },
        )
    )
    assert p.sync.backend == "gloo"
    assert env_of(p, "trainer", 0)["LORARL_SYNC_BACKEND"] == "gloo"
    for r in p.role("rollout").replicas:
        engine, sidecar = r.containers
        assert sidecar.env["LORARL_SYNC_BACKEND"] == "gloo"
        assert "nvidia.com/gpu" not in sidecar.resources.limits
        assert "LORARL_SYNC_BACKEND" not in engine.env
    assert "LORARL_SYNC_BACKEND" in RESERVED_ENV


def test_cpu_job_uses_gloo_and_vllm_flags():
    p = plan(
        make(
            trainer={"gpusPerReplica": 0, "processesPerReplica": 2},
            rollout={"engine": "vllm", "gpusPerReplica": 0, "syncMode": "adapter"},
        )
    )
    assert p.sync.backend == "gloo"
    assert env_of(p, "trainer", 0)["NPROC_PER_NODE"] == "2"
    engine = p.role("rollout").replicas[0].containers[0]
    assert "--enable-lora" in engine.command and "--enforce-eager" in engine.command
    assert engine.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # a CPU engine compiles nothing: no Inductor build stalls its first step
    assert engine.env["TORCHDYNAMO_DISABLE"] == "1"


def test_a_gpu_engine_keeps_torch_compile():
    p = plan(make(rollout={"engine": "vllm", "gpusPerReplica": 1}))
    assert "TORCHDYNAMO_DISABLE" not in p.role("rollout").replicas[0].containers[0].env


def test_user_env_cannot_override_reserved_names():
    job = make(trainer={"env": [{"name": "HF_HOME", "value": "/c"}]})
    p = plan(job)
    trainer = p.role("trainer").replicas[0].containers[0]
    assert [e.name for e in trainer.user_env] == ["HF_HOME"]
    assert set(trainer.env) <= set(RESERVED_ENV)  # rendered env only holds reserved names
    # bypass validation: the plan itself still refuses
    bad = job.model_copy(deep=True)
    bad.spec.trainer.env[0].name = "MASTER_PORT"
    with pytest.raises(ValueError, match="MASTER_PORT"):
        plan(bad)


def test_reward_role_only_when_lorarl_runs_the_service():
    assert plan(make()).role("reward") is None
    own = plan(make(reward={"function": "math_answer", "service": {}}))
    assert own.role("reward") is not None
    assert env_of(own, "trainer", 0)["LORARL_REWARD_ENDPOINT"] == "http://job-reward-0.job:8000"
    external = plan(make(reward={"function": "x", "service": {"url": "http://rs:8000"}}))
    assert external.role("reward") is None
    assert env_of(external, "trainer", 0)["LORARL_REWARD_ENDPOINT"] == "http://rs:8000"


def test_local_addressing_gives_distinct_loopback_ports():
    p = plan(make(rollout={"replicas": 3}), LocalAddressing(base_port=41000))
    ports = [
        port
        for role in p.roles
        for r in role.replicas
        for c in r.containers
        for port in c.ports.values()
    ]
    ports.append(p.sync.port)
    assert len(ports) == len(set(ports)) + 1  # the sync port appears once as a container port too
    assert all(41000 <= port < 41000 + LocalAddressing.ports_needed(3) for port in ports)
    assert p.sync.address == "127.0.0.1"


def test_plan_is_deterministic():
    a = plan(make(rollout={"replicas": 2})).model_dump_json()
    b = plan(make(rollout={"replicas": 2})).model_dump_json()
    assert a == b


def test_config_is_the_fully_defaulted_job():
    p = plan(make())
    assert p.config["spec"]["algorithm"]["groupSize"] == 8
    # left unset: an adapterPath's own rank, else 32, decided where the adapter is read
    assert "rank" not in p.config["spec"]["lora"]
    assert LoRARLJob.model_validate(p.config).spec == make().spec
