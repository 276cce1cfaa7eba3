"""rollout.placement colocated: the plan, the pods the operator builds from it, and a local run's
processes. (The rules' messages are pinned by examples/bad/colocated-*.yaml.)"""

from __future__ import annotations

import copy
import json

import pytest

from lorarl.api import LoRARLJob
from lorarl.api.spec.placement import COLOCATED_PROCESSES_ENV, releases_engine_memory
from lorarl.api.validation import check_manifest
from lorarl.operator.builders import network_policy, pod, pod_group, pod_names
from lorarl.plan import LocalAddressing, plan
from lorarl.plan.build import DEFAULT_IMAGES

BASE = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "job", "namespace": "ml"},
    "spec": {
        "model": {"path": "/models/m"},
        "data": {"trainFiles": ["t.jsonl"]},
        "rollout": {"placement": "colocated"},
    },
}


def doc(**spec) -> dict:
    d = copy.deepcopy(BASE)
    for key, value in spec.items():
        d["spec"][key] = {**d["spec"].get(key, {}), **value}
    return d


def make(**spec) -> LoRARLJob:
    return LoRARLJob.model_validate(doc(**spec))


def test_separate_is_the_default_and_keeps_rollout_pods():
    d = doc()
    del d["spec"]["rollout"]["placement"]
    p = plan(LoRARLJob.model_validate(d))
    assert p.placement == "separate"
    assert [r.role for r in p.roles] == ["trainer", "rollout"]
    assert [c.name for c in p.role("trainer").replicas[0].containers] == ["trainer"]


def test_each_trainer_pod_runs_one_engine_and_its_sidecar():
    job = make(trainer={"replicas": 2, "gpusPerReplica": 4}, rollout={"replicas": 2,
               "gpusPerReplica": 4, "tensorParallelSize": 4})  # fmt: skip
    p = plan(job)
    assert p.placement == "colocated" and [r.role for r in p.roles] == ["trainer"]
    for i, replica in enumerate(p.role("trainer").replicas):
        assert [c.name for c in replica.containers] == ["trainer", "engine", "sidecar"]
        sidecar = replica.containers[2].env
        assert sidecar["LORARL_ADVERTISED_ENGINE_URL"] == f"http://job-trainer-{i}.job:30000"
        assert sidecar["LORARL_ENGINE_URL"] == "http://127.0.0.1:30000"  # its own pod's engine
        assert sidecar["LORARL_ROLLOUT_INDEX"] == str(i)
    trainer = p.role("trainer").replicas[0].containers[0].env
    assert trainer["LORARL_ROLLOUT_ENDPOINTS"] == (
        "http://job-trainer-0.job:30000,http://job-trainer-1.job:30000"
    )
    assert p.sync.world_size == 3  # rank 0 + one sidecar per trainer pod
    engine = p.role("trainer").replicas[0].containers[1]
    assert engine.command[engine.command.index("--tp-size") + 1] == "4"


def test_a_colocated_gpu_engine_leaves_the_trainer_memory_unless_told_otherwise():
    sglang = plan(make()).role("trainer").replicas[0].containers[1].command
    assert sglang[sglang.index("--mem-fraction-static") + 1] == "0.5"
    vllm = plan(make(rollout={"engine": "vllm", "memoryFraction": 0.7}))
    command = vllm.role("trainer").replicas[0].containers[1].command
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.7"
    separate = plan(make(rollout={"placement": "separate"})).role("rollout")
    command = separate.replicas[0].containers[0].command
    assert command[command.index("--mem-fraction-static") + 1] == "0.85"


def test_the_pod_runs_the_engines_image_unless_the_trainer_names_one():
    assert (
        plan(make()).role("trainer").replicas[0].containers[0].image
        == (DEFAULT_IMAGES["rollout-sglang"])
    )
    own = plan(make(trainer={"image": "reg/mine:1"})).role("trainer").replicas[0]
    assert {c.image for c in own.containers} == {"reg/mine:1"}


def test_the_operator_builds_one_container_holding_the_gpus_and_every_process():
    job = make(trainer={"gpusPerReplica": 2, "env": [{"name": "NCCL_DEBUG", "value": "WARN"}]},
               rollout={"gpusPerReplica": 2, "tensorParallelSize": 2})  # fmt: skip
    p = plan(job)
    assert pod_names(p) == ["job-trainer-0"]
    (container,) = pod(p, job, "trainer", 0)["spec"]["containers"]
    assert container["command"] == ["python", "-m", "lorarl.colocate"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    env = {e["name"]: e for e in container["env"]}
    assert container["env"][0]["name"] == "LORARL_ENGINE_API_KEY"  # before the references to it
    assert "secretKeyRef" in env["LORARL_SYNC_KEY"]["valueFrom"]
    assert env["NCCL_DEBUG"]["value"] == "WARN"  # the trainer's env reaches every process
    procs = json.loads(env[COLOCATED_PROCESSES_ENV]["value"])
    assert [x["name"] for x in procs] == ["engine", "sidecar", "trainer"]  # the trainer last
    replica = p.role("trainer").replicas[0]
    assert [x["command"] for x in procs] == [c.command for c in replica.containers[1:]] + [
        replica.containers[0].command
    ]
    assert "$(LORARL_ENGINE_API_KEY)" in procs[0]["command"]  # expanded by the kubelet
    ports = {x["name"]: x["containerPort"] for x in container["ports"]}
    assert set(ports) == {"master", "sync", "progress", "engine", "sidecar"}
    paths = [m["mountPath"] for m in container["volumeMounts"]]
    assert len(paths) == len(set(paths))


def test_the_gang_and_the_network_policy_cover_the_colocated_pods():
    job = make(trainer={"replicas": 2, "gpusPerReplica": 1}, rollout={"replicas": 2})
    p = plan(job)
    job.spec.scheduling.gang = "volcano"
    assert pod_group(p, job)["spec"]["minMember"] == 2
    # Trainer pods reach each other's engines and sidecars: any port from the job's own pods.
    ingress = network_policy(p, "lorarl-system")["spec"]["ingress"][0]
    assert "ports" not in ingress
    assert ingress["from"][0]["podSelector"]["matchLabels"]["lorarl.dev/job"] == "job"


def test_local_ports_of_colocated_processes_never_collide():
    job = make(trainer={"gpusPerReplica": 0, "processesPerReplica": 2},
               rollout={"engine": "vllm", "gpusPerReplica": 0})  # fmt: skip
    p = plan(job, LocalAddressing(20000))
    ports = [port for r in p.roles for x in r.replicas for c in x.containers
             for port in c.ports.values()]  # fmt: skip
    assert len(ports) == len(set(ports)) == 5
    assert max(ports) < 20000 + LocalAddressing.ports_needed(1)


@pytest.mark.parametrize(("gpus", "releases"), [(0, False), (1, True)])
def test_only_gpu_engines_release_memory(gpus, releases):
    job = make(trainer={"gpusPerReplica": gpus},
               rollout={"engine": "vllm", "gpusPerReplica": gpus})  # fmt: skip
    assert releases_engine_memory(job.spec) is releases
    separate = make(rollout={"placement": "separate"})
    assert releases_engine_memory(separate.spec) is False


@pytest.mark.parametrize(
    ("rollout", "field"),
    [
        ({"image": "reg/engine:1"}, "spec.rollout"),
        ({"resources": {"limits": {"memory": "8Gi"}}}, "spec.rollout"),
        ({"env": [{"name": "A", "value": "1"}]}, "spec.rollout"),
        ({"preemptible": True}, "spec.rollout"),
        ({"tolerations": [{"key": "k", "operator": "Exists"}]}, "spec.rollout"),
        ({"nodeSelector": {"pool": "inference"}}, "spec.rollout"),
        ({"replicas": 2}, "spec.rollout.replicas"),
        ({"gpusPerReplica": 0, "engine": "vllm"}, "spec.rollout.gpusPerReplica"),
    ],
)
def test_rollout_pod_fields_are_refused_not_ignored(rollout, field):
    problems = [str(p) for p in check_manifest(doc(rollout=rollout))]
    assert any(p.startswith(f"{field}:") for p in problems), problems
    separate = doc(rollout={**rollout, "placement": "separate"})
    assert not [p for p in check_manifest(separate) if str(p).startswith(f"{field}:")]


def test_off_policy_overlap_is_refused_on_gpus_only():
    gpu = [str(p) for p in check_manifest(doc(training={"offPolicySteps": 1}))]
    assert any(p.startswith("spec.training.offPolicySteps:") for p in gpu), gpu
    cpu = doc(training={"offPolicySteps": 1}, trainer={"gpusPerReplica": 0},
              rollout={"gpusPerReplica": 0, "engine": "vllm"})  # fmt: skip
    assert not [p for p in check_manifest(cpu) if p.path == "spec.training.offPolicySteps"]


def _colocated_processes(job: LoRARLJob) -> list[dict]:
    (container,) = pod(plan(job), job, "trainer", 0)["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    return json.loads(env[COLOCATED_PROCESSES_ENV]["value"])


def test_only_the_trainer_process_keeps_the_tracker_key_the_container_holds():
    """One container holds the trainer's env, its W&B key included; the engine and sidecar
    drop it (in separate pods their containers never had it), but keep the user's own env."""
    job = make(
        trainer={"env": [{"name": "NCCL_DEBUG", "value": "WARN"}]},
        logging={"backends": ["wandb"],
                 "wandb": {"project": "p", "apiKeySecret": {"name": "wandb", "key": "k"}}},
    )  # fmt: skip
    engine, sidecar, trainer = _colocated_processes(job)
    assert engine["unsetEnv"] == sidecar["unsetEnv"] == ["WANDB_API_KEY"]
    assert "unsetEnv" not in trainer


def test_on_gpus_the_trainer_starts_once_its_engine_listens():
    gpu = make(trainer={"gpusPerReplica": 2}, rollout={"gpusPerReplica": 2,
               "tensorParallelSize": 2})  # fmt: skip
    engine, _, trainer = _colocated_processes(gpu)
    port = plan(gpu).role("trainer").replicas[0].containers[1].ports["engine"]
    assert trainer["waitForPorts"] == [port] and "waitForPorts" not in engine
    cpu = make(trainer={"gpusPerReplica": 0},
               rollout={"engine": "vllm", "gpusPerReplica": 0})  # fmt: skip
    assert "waitForPorts" not in _colocated_processes(cpu)[-1]  # nothing to measure on a CPU
