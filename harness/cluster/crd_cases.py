"""Manifests on both sides of every CRD rule: the examples (good and bad) and boundary variants.
tests/cluster/test_crd.py sends each to a real API server and checks it agrees with the models."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml")) + sorted(
    (ROOT / "examples" / "bad").glob("*.yaml")
)


def _docs():
    for path in EXAMPLES:
        try:
            doc = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            continue  # rejected before either validator sees it
        yield path.stem, doc


def secret(name: str) -> dict:
    return {"secretKeyRef": {"name": name, "key": "k"}}


def _variants():
    """Boundary cases around every rule, so agreement is tested on both sides of each."""
    base = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    out = {k: base["spec"]["training"][k] for k in ("outputDir", "volume")}
    patches = [
        ("lora", {"rank": 1024}), ("lora", {"rank": 1025}), ("lora", {"alpha": 0.001}),
        ("lora", {"targetModules": ["q_proj", "v_proj"]}), ("lora", {"targetModules": []}),
        ("algorithm", {"name": "dapo", "groupSize": 2}),
        ("algorithm", {"name": "rloo", "groupSize": 1}),
        ("algorithm", {"name": "reinforce_pp", "groupSize": 1}),
        ("algorithm", {"name": "ppo", "groupSize": 1}),
        ("algorithm", {"dynamicSampling": {"enabled": True}, "groupSize": 2}),
        ("rollout", {"gpusPerReplica": 8, "tensorParallelSize": 4}),
        ("rollout", {"gpusPerReplica": 8, "tensorParallelSize": 3}),
        ("rollout", {"gpusPerReplica": 0, "tensorParallelSize": 1}),
        ("training", {**out, "promptsPerStep": 8, "miniBatchSize": 16}),
        ("training", {**out, "promptsPerStep": 8, "miniBatchSize": 7}),
        ("training", {"totalSteps": 5}),  # no volume: outputs would die with the pod
        ("training", {**out, "epochs": 2.5}), ("training", {**out, "epochs": 0}),
        ("training", {**out, "epochs": 1, "totalSteps": 5}),  # one of them, not both
        ("training", {**out, "resume": "never"}), ("training", {**out, "resume": "always"}),
        ("training", {**out, "outputDir": "/outputs"}),
        ("training", {**out, "outputDir": "/outputs/a/b"}),
        ("training", {**out, "outputDir": "/outputsx"}),
        ("training", {**out, "outputDir": "/workspace/output"}),
        ("training", {**out, "maxTokensPerMicroBatch": 4096}),
        ("training", {**out, "maxTokensPerMicroBatch": 0}),
        ("trainer", {"gpusPerReplica": 1, "fsdp": {"offloadParams": True}}),
        ("trainer", {"gpusPerReplica": 0, "fsdp": {"offloadParams": False}}),
        ("trainer", {"activationCheckpointing": False}),
        ("training", {"volume": {"claimName": "o", "mountPath": "/workspace/output"}}),
        ("training", {"volume": {"claimName": "o", "mountPath": "/workspace/"}}),
        ("training", {"volume": {"claimName": "o", "mountPath": "/"}}),
        ("reward", {"entrypoint": "pkg.mod:fn"}),
        ("reward", {"entrypoint": "pkg.mod:fn", "service": {"url": "http://rm:8000"}}),
        ("reward", {"function": "exact_match", "service": {}}),
        ("reward", {}),
        ("reward", {"entrypoint": "/r/x.py:fn"}), ("reward", {"entrypoint": "r/x.py:fn"}),
        ("reward", {"entrypoint": "/r/x.py:fn", "configMap": {"name": "r", "mountPath": "/r"}}),
        ("reward", {"entrypoint": "/r/x.py:fn", "configMap": {"name": "r", "mountPath": "/r/"}}),
        ("reward", {"entrypoint": "/rx/x.py:fn", "configMap": {"name": "r", "mountPath": "/r"}}),
        ("reward", {"entrypoint": "pkg.mod:fn", "configMap": {"name": "r", "mountPath": "/r"}}),
        ("reward", {"function": "exact_match", "configMap": {"name": "r", "mountPath": "/r"}}),
        ("reward", {"entrypoint": "/r/x.py:fn", "service": {}}),
        ("reward", {"entrypoint": "/r/x.py:fn", "service": {},
                    "configMap": {"name": "r", "mountPath": "/r"}}),
        ("reward", {"entrypoint": "/r/x.py:fn", "service": {"url": "http://rm:8000"},
                    "configMap": {"name": "r", "mountPath": "/r"}}),
        ("reward", {"entrypoint": "/tmp/x.py:fn", "configMap": {"name": "r", "mountPath": "/tmp"}}),
        ("reward", {"entrypoint": "/outputs/x.py:fn",
                    "configMap": {"name": "r", "mountPath": "/outputs"}}),
        ("reward", {"entrypoint": "/r/x.py:fn", "configMap": {"name": "R_", "mountPath": "/r"}}),
        ("reward", {"entrypoint": "/x.py:fn", "configMap": {"name": "r", "mountPath": "/"}}),
        ("trainer", {"env": [{"name": "HF_HOME", "value": "/cache"}]}),
        ("trainer", {"env": [{"name": "RANK", "value": "0"}]}),
        ("optim", {"lr": 0}), ("optim", {"betas": [0.9, 0.95]}),
        ("trainer", {"resources": {"limits": {"memory": "16Gi", "cpu": "500m"}}}),
        ("trainer", {"resources": {"limits": {"cpu": 4, "ephemeral-storage": "1e3"}}}),
        ("trainer", {"resources": {"limits": {"memory": "16GB"}}}),
        ("trainer", {"resources": {"limits": {"cpu": -1}}}),
        ("trainer", {"resources": {"limits": {"cpu": 1.5}}}),
        ("trainer", {"resources": {"limits": {"example.com/fpga": 1}}}),
        ("trainer", {"resources": {"limits": {"fpga": 1}}}),
        ("trainer", {"resources": {"limits": {"hugepages-2Mi": "1Gi"}}}),
        ("trainer", {"nodeSelector": {"pool": "a" * 64}}),
        ("trainer", {"nodeSelector": {"pool": "gpu_a-1.x"}}),
        ("trainer", {"env": [{"name": "T", "valueFrom": secret("a.b-c")}]}),
        ("trainer", {"env": [{"name": "T", "valueFrom": secret("A")}]}),
        ("trainer", {"tolerations": [{"key": "k", "operator": "Exists", "value": ""}]}),
        ("trainer", {"tolerations": [{"key": "k", "effect": "NoExecute", "tolerationSeconds": 5}]}),
        ("model", {"path": "/m", "volume": {"claimName": "m", "mountPath": "/tmp"}}),
        ("model", {"path": "/m", "volume": {"claimName": "m", "mountPath": "/outputs"}}),
        ("model", {"path": "/m", "volume": {"claimName": "m", "mountPath": "/models"}}),
        ("model", {"path": "/m", "volume": {"claimName": "Bad_Claim", "mountPath": "/models"}}),
        ("scheduling", {"queueName": "team-q"}), ("scheduling", {"queueName": "Team_Q"}),
        ("scheduling", {"priorityClassName": "high.prio"}),
        ("runPolicy", {"activeDeadlineSeconds": 0}),
        ("runPolicy", {"activeDeadlineSeconds": 315_360_000}),
        ("runPolicy", {"activeDeadlineSeconds": 10**30}),
        ("data", {"trainFiles": ["t.jsonl"], "seed": 10**40}),
        ("lora", {"alpha": 65536}), ("lora", {"alpha": 65536.5}),
        ("optim", {"betas": [0.9, 1.0]}),
        ("scheduling", {"priorityClassName": "system-cluster-critical"}),
        ("scheduling", {"priorityClassName": "systemic"}),
        ("rollout", {"engineArgs": ["--host", "0.0.0.0"]}),  # Python only: the CRD accepts
        ("reward", {"function": "no_such_reward"}),  # Python only: the CRD accepts
        # Typed as the CRD types them: no quoted number or boolean, camelCase keys only, and a
        # whole float is an integer (the server reads `rank: 16.0` as 16).
        ("lora", {"rank": "16"}), ("lora", {"rank": 16.0}), ("lora", {"rank": 16.5}),
        ("lora", {"rank": True}), ("lora", {"alpha": "16"}), ("lora", {"lora_rank": 16}),
        ("data", {"trainFiles": ["t.jsonl"], "shuffle": "true"}),
        ("data", {"trainFiles": ["t.jsonl"], "shuffle": 1}),
        ("training", {**out, "total_steps": 5}), ("training", {**out, "totalSteps": 5.0}),
        ("trainer", {"resources": {"limits": {"cpu": 4.0}}}),
        ("rollout", {"sampling": {"temperature": "0.7"}}),
    ]  # fmt: skip
    for i, (section, value) in enumerate(patches):
        doc = copy.deepcopy(base)
        doc["spec"][section] = value
        yield f"variant-{i}-{section}", doc
    for name in ("a", "ab-1", "1abc", "Upper", "x" * 40, "x" * 41, "trailing-"):
        doc = copy.deepcopy(base)
        doc["metadata"]["name"] = name
        yield f"name-{name[:12]}", doc
    # critic.warmupSteps against the step count: the default 100 steps, or none known (epochs)
    for i, training in enumerate(({**out}, {**out, "epochs": 1}, {**out, "totalSteps": 300})):
        doc = copy.deepcopy(base)
        doc["spec"]["algorithm"] = {"name": "ppo", "groupSize": 1}
        doc["spec"]["critic"] = {"warmupSteps": 200}
        doc["spec"]["training"] = training
        yield f"critic-warmup-{i}", doc


CASES = list(itertools.chain(_docs(), _variants()))
