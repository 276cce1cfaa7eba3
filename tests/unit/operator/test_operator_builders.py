"""Builders: a JobPlan -> Kubernetes objects that the official schemas accept."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kopf
import kubernetes_validate
import pytest
import yaml

from lorarl.api.validation import parse_job
from lorarl.operator import builders
from lorarl.plan import plan

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
OWNER = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "quickstart", "namespace": "team", "uid": "u-1"},
}


def job(**spec: Any):
    doc = copy.deepcopy(QUICKSTART)
    doc["metadata"]["namespace"] = "team"
    for key, value in spec.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
    j = parse_job(doc)
    return j, plan(j)


def everything(j, p) -> list[dict[str, Any]]:
    objs = [
        builders.service(p),
        builders.config_map(p),
        builders.engine_key_secret(p, "k", "s"),
        builders.network_policy(p, "lorarl-system"),
    ]
    objs += [builders.pod(p, j, role.role, r.index) for role in p.roles for r in role.replicas]
    group = builders.pod_group(p, j)
    return objs + ([group] if group else [])


@pytest.mark.parametrize("version", ["1.30", "1.34"])
def test_every_object_passes_the_official_schema_after_adoption(version: str) -> None:
    j, p = job(
        scheduling={"queueName": "q", "priorityClassName": "high"},
        trainer={
            "env": [
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
            ],
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "nodeSelector": {"pool": "a"},
        },
        model={"volume": {"claimName": "models", "mountPath": "/models"}},
    )
    objs = [o for o in everything(j, p) if o["kind"] != "PodGroup"]
    kopf.adopt(objs, owner=OWNER)
    assert len(objs) == 4 + 3
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "lorarl.dev/v1alpha1",
                "kind": "LoRARLJob",
                "name": "quickstart",
                "uid": "u-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert obj["metadata"]["namespace"] == "team"


def test_pods_are_hardened_and_addressable() -> None:
    j, p = job()
    pod = builders.pod(p, j, "trainer", 0)
    spec = pod["spec"]
    assert (pod["metadata"]["name"], spec["hostname"], spec["subdomain"]) == (
        "quickstart-trainer-0",
        "quickstart-trainer-0",
        "quickstart",
    )
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    rollout = builders.pod(p, j, "rollout", 1)["spec"]
    assert rollout["restartPolicy"] == "Always"  # a crashed engine or sidecar restarts in place
    for c in [*spec["containers"], *builders.pod(p, j, "rollout", 1)["spec"]["containers"]]:
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    labels = pod["metadata"]["labels"]
    assert {
        k: labels[k]
        for k in (
            "lorarl.dev/job",
            "lorarl.dev/role",
            "lorarl.dev/replica-index",
            "lorarl.dev/attempt",
        )
    } == {
        "lorarl.dev/job": "quickstart",
        "lorarl.dev/role": "trainer",
        "lorarl.dev/replica-index": "0",
        "lorarl.dev/attempt": "0",
    }
    assert (
        builders.pod(p, j, "trainer", 0, attempt=2)["metadata"]["labels"]["lorarl.dev/attempt"]
        == "2"
    )


def _writable_roots(container: dict[str, Any]) -> list[str]:
    return [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]


def test_the_trainer_writes_its_outputs_to_a_writable_claim_that_outlives_the_pod() -> None:
    """The root filesystem is read-only: outputDir must be on a read-write PVC mount."""
    j, p = job()
    spec = builders.pod(p, j, "trainer", 0)["spec"]
    out = j.spec.training.output_dir
    mounts = [
        m
        for m in spec["containers"][0]["volumeMounts"]
        if out == m["mountPath"] or out.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert len(mounts) == 1 and not mounts[0].get("readOnly"), mounts
    volume = next(v for v in spec["volumes"] if v["name"] == mounts[0]["name"])
    assert volume == {"name": "output", "persistentVolumeClaim": {"claimName": "lorarl-outputs"}}


def test_env_is_rendered_then_user_env_verbatim() -> None:
    secret_ref = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    j, p = job(trainer={"env": [{"name": "LOG", "value": "debug"}, secret_ref]})
    env = builders.pod(p, j, "trainer", 0)["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    rendered = p.role("trainer").replicas[0].containers[0].env
    # the key first (later values may reference it), then the plan's order, ours, the user's
    assert names[0] == "LORARL_ENGINE_API_KEY"
    assert names[1 : len(rendered) + 1] == list(rendered)
    assert env[-2:] == [{"name": "LOG", "value": "debug"}, secret_ref]
    by_name = {e["name"]: e for e in env}
    assert by_name["WORLD_SIZE"]["value"] == "2"  # 1 node x processesPerReplica 2
    assert by_name["LORARL_ENGINE_API_KEY"] == {
        "name": "LORARL_ENGINE_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "quickstart-engine-key", "key": "api-key"}},
    }
    assert by_name["HOME"]["value"] == "/tmp"
    user_home = job(trainer={"env": [{"name": "HOME", "value": "/work"}]})
    env = builders.pod(user_home[1], user_home[0], "trainer", 0)["spec"]["containers"][0]["env"]
    assert [e.get("value") for e in env if e["name"] == "HOME"] == ["/work"]


def test_rollout_pod_shares_memory_volume_between_engine_and_sidecar() -> None:
    j, p = job()
    spec = builders.pod(p, j, "rollout", 1)["spec"]
    assert [c["name"] for c in spec["containers"]] == ["engine", "sidecar"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory"}}
    assert volumes["config"] == {"name": "config", "configMap": {"name": "quickstart-config"}}
    for c in spec["containers"]:
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert {"name": "config", "mountPath": "/etc/lorarl", "readOnly": True} in c["volumeMounts"]
        assert c["env"][0]["name"] == "LORARL_ENGINE_API_KEY"
    sidecar = {e["name"]: e.get("value") for e in spec["containers"][1]["env"]}
    assert sidecar["LORARL_ROLLOUT_INDEX"] == "1" and "LORARL_SYNC_WORLD_SIZE" not in sidecar
    assert sidecar["LORARL_ADVERTISED_ENGINE_URL"] == "http://quickstart-rollout-1.quickstart:30000"
    assert spec["containers"][0]["ports"] == [
        {"name": "engine", "containerPort": 30000, "protocol": "TCP"}
    ]


def test_every_pod_has_a_memory_backed_dev_shm_and_logs_as_termination_message() -> None:
    """NCCL, DataLoader workers, vLLM and Ray need more than the runtime's 64 MiB /dev/shm; a
    failed container's last log lines are its termination message (what `Failed` shows)."""
    j, p = job(reward={"function": "exact_match", "params": {}, "service": {}})
    roles = {role.role: len(role.replicas) for role in p.roles}
    assert roles == {"trainer": 1, "rollout": 2, "reward": 1}
    for role, count in roles.items():
        for i in range(count):
            spec = builders.pod(p, j, role, i)["spec"]
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert volumes["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory"}}, role
            for c in spec["containers"]:
                assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"], role
                assert c["terminationMessagePolicy"] == "FallbackToLogsOnError", role


def test_engines_get_the_key_by_reference_never_by_value() -> None:
    """vLLM reads VLLM_API_KEY, SGLang takes --api-key: both as `$(VAR)` the kubelet expands."""
    j, p = job()
    engine = builders.pod(p, j, "rollout", 0)["spec"]["containers"][0]
    assert engine["name"] == "engine"
    by_name = {e["name"]: e for e in engine["env"]}
    assert by_name["VLLM_API_KEY"] == {"name": "VLLM_API_KEY", "value": "$(LORARL_ENGINE_API_KEY)"}
    names = [e["name"] for e in engine["env"]]
    assert names.index("LORARL_ENGINE_API_KEY") < names.index("VLLM_API_KEY")
    j, p = job(rollout={"engine": "sglang", "gpusPerReplica": 1, "kvCacheGib": None})
    engine = builders.pod(p, j, "rollout", 0)["spec"]["containers"][0]
    argv = engine["command"]
    assert argv[argv.index("--api-key") + 1] == "$(LORARL_ENGINE_API_KEY)"
    assert "VLLM_API_KEY" not in {e["name"] for e in engine["env"]}


def test_gpus_become_limits() -> None:
    j, p = job(
        trainer={"gpusPerReplica": 4, "processesPerReplica": None},
        rollout={
            "gpusPerReplica": 2,
            "tensorParallelSize": 2,
            "engine": "sglang",
            "kvCacheGib": None,
        },
    )
    trainer = builders.pod(p, j, "trainer", 0)["spec"]["containers"][0]
    assert trainer["resources"] == {"limits": {"nvidia.com/gpu": "4"}}
    engine = builders.pod(p, j, "rollout", 0)["spec"]["containers"][0]
    assert engine["resources"] == {"limits": {"nvidia.com/gpu": "2"}}


def test_service_config_and_secret() -> None:
    j, p = job()
    svc = builders.service(p)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"] == {"lorarl.dev/job": "quickstart"}
    assert {x["port"] for x in svc["spec"]["ports"]} == {29500, 29600, 8080, 30000, 8001, 8000}
    cm = builders.config_map(p)
    assert cm["metadata"]["name"] == "quickstart-config"
    assert yaml.safe_load(cm["data"]["job.yaml"]) == p.config
    assert parse_job(yaml.safe_load(cm["data"]["job.yaml"])).spec == j.spec
    secret = builders.engine_key_secret(p, "s3cr3t", "sync-s3cr3t")
    assert (secret["metadata"]["name"], secret["stringData"]) == (
        "quickstart-engine-key",
        {"api-key": "s3cr3t", "sync-key": "sync-s3cr3t"},
    )
    with pytest.raises(ValueError, match="must not be empty"):
        builders.engine_key_secret(p, "", "s")
    with pytest.raises(ValueError, match="sync key: must not be empty"):
        builders.engine_key_secret(p, "k", "")


def _admits(policy: dict[str, Any], ns: str, labels: dict[str, str], port: int) -> bool:
    """NetworkPolicy ingress semantics, for a peer pod in namespace `ns` (the job's is "team")."""

    def selects(sel: dict[str, Any], have: dict[str, str]) -> bool:
        ok = all(have.get(k) == v for k, v in sel.get("matchLabels", {}).items())
        for e in sel.get("matchExpressions", []):
            assert e["operator"] == "In"
            ok = ok and have.get(e["key"]) in e["values"]
        return ok

    def peer_ok(peer: dict[str, Any]) -> bool:
        if "namespaceSelector" in peer:
            ns_ok = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": ns})
        else:
            ns_ok = ns == policy["metadata"]["namespace"]
        return ns_ok and selects(peer.get("podSelector", {}), labels)

    for rule in policy["spec"]["ingress"]:
        ports = rule.get("ports")
        if any(peer_ok(x) for x in rule["from"]) and (
            ports is None or any(x["port"] == port for x in ports)
        ):
            return True
    return False


def test_network_policy_admits_everything_from_the_job_and_progress_from_the_operator() -> None:
    j, p = job()
    policy = builders.network_policy(p, "ops")
    assert policy["spec"]["podSelector"]["matchLabels"]["lorarl.dev/job"] == "quickstart"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    same_job = builders.pod(p, j, "rollout", 0)["metadata"]["labels"]
    # gloo and NCCL connect on ephemeral ports besides the rendezvous and sync ports
    for port in (29500, 29600, 30000, 8001, 8000, 8080, 41234, 60999):
        assert _admits(policy, "team", same_job, port), port
    other_job = {**same_job, "lorarl.dev/job": "other"}
    assert not _admits(policy, "team", other_job, 29600)
    assert not _admits(policy, "elsewhere", same_job, 29600)  # same labels, other namespace
    operator = {"app.kubernetes.io/name": "lorarl", "app.kubernetes.io/component": "operator"}
    status_api = {**operator, "app.kubernetes.io/component": "status-api"}
    for peer in (operator, status_api):
        assert _admits(policy, "ops", peer, 8080)
        assert not _admits(policy, "ops", peer, 29500)
        assert not _admits(policy, "team", peer, 8080)
    assert not _admits(policy, "ops", {"app.kubernetes.io/name": "lorarl"}, 8080)


def test_queue_and_gang_scheduling() -> None:
    j, p = job(scheduling={"queueName": "team-q", "gang": "scheduler-plugins"})
    meta = builders.pod(p, j, "rollout", 0)["metadata"]
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-q"
    assert meta["labels"]["kueue.x-k8s.io/pod-group-name"] == "quickstart"
    assert meta["labels"]["scheduling.x-k8s.io/pod-group"] == "quickstart"
    assert meta["annotations"] == {"kueue.x-k8s.io/pod-group-total-count": "3"}
    group = builders.pod_group(p, j)
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"] == {"minMember": 3}
    j, p = job(scheduling={"gang": "volcano"}, trainer={"replicas": 2})
    group = builders.pod_group(p, j)
    assert (group["apiVersion"], group["spec"]["minMember"]) == ("scheduling.volcano.sh/v1beta1", 4)
    pod = builders.pod(p, j, "trainer", 1)
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["metadata"]["annotations"] == {"scheduling.k8s.io/group-name": "quickstart"}
    assert "kueue.x-k8s.io/queue-name" not in pod["metadata"]["labels"]
    plain_job, plain_plan = job()
    assert builders.pod_group(plain_plan, plain_job) is None


def test_unknown_replica_is_an_error() -> None:
    j, p = job()
    with pytest.raises(ValueError, match="has no rollout replica 2"):
        builders.pod(p, j, "rollout", 2)


def test_only_the_reward_pod_goes_without_the_engine_key() -> None:
    """The reward service scores untrusted completions (python_tests): it must not be able to
    drive the engines, so its pod gets no reference to the engine key: only its own (the reward
    key, which only lets its holder ask for scores)."""
    j, p = job(reward={"function": "exact_match", "params": {}, "service": {}})
    for role in ("trainer", "rollout", "reward"):
        pod = builders.pod(p, j, role, 0)
        refs = [
            (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for c in pod["spec"]["containers"]
            for e in c["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        ]
        values = " ".join(e.get("value", "") for c in pod["spec"]["containers"] for e in c["env"])
        if role == "reward":
            assert refs == [(builders.secret_name(j.name), builders.REWARD_KEY_KEY)]
            assert "LORARL_ENGINE_API_KEY" not in values
        else:
            assert (builders.secret_name(j.name), builders.API_KEY_KEY) in refs, role
