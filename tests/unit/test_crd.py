"""The generated CRD: committed copy up to date, structurally sound, and in agreement with the
pydantic models on every example (CEL rules evaluated with a real CEL engine)."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import yaml

from lorarl.api.crd import crd, crd_yaml
from lorarl.api.validation import check_manifest
from tests.support.crd_validator import CrdValidator

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "lorarljobs.lorarl.dev.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml")) + sorted(
    (ROOT / "examples" / "bad").glob("*.yaml")
)


@pytest.fixture(scope="module")
def validator() -> CrdValidator:
    return CrdValidator(yaml.safe_load(CRD_PATH.read_text()))


def test_committed_crd_matches_the_models():
    assert CRD_PATH.read_text() == crd_yaml(), "crds/ is stale: run `make crds`"


def test_crd_shape():
    version = crd()["spec"]["versions"][0]
    names = crd()["spec"]["names"]
    assert names["shortNames"] == ["lrj"] and "all" in names["categories"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.rollout.replicas"
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert {"Phase", "Step", "Reward", "Sync", "Age"} <= set(columns)
    assert columns["Eval"]["jsonPath"] == ".status.eval.accuracy" and columns["Eval"]["priority"]
    # conditions are read by type, never by position
    condition_paths = [c["jsonPath"] for c in columns.values() if "conditions" in c["jsonPath"]]
    assert condition_paths and all("?(@.type==" in p for p in condition_paths)


def _walk(schema, path=""):
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural_and_documented():
    root = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            continue
        assert "type" in node, f"{path} has no type"
        # OpenAPI v3.0 (what the API server speaks): exclusive bounds are booleans
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(key, True) is True, path
        if path.startswith(".spec.") and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path} has no description"


def test_every_number_in_the_spec_is_bounded():
    """Both bounds on every integer and number a user writes (the API server refuses the rest,
    e.g. a seed of 10**40 or a deadline of 10**30, before the webhook is even asked)."""
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    numbers = 0
    for path, node in _walk(spec):
        if node.get("type") in ("integer", "number") or node.get("x-kubernetes-int-or-string"):
            numbers += 1
            assert "minimum" in node and "maximum" in node, f"{path} is unbounded: {node}"
    assert numbers >= 50
    props = spec["properties"]
    assert props["lora"]["properties"]["alpha"]["maximum"] == 65536
    assert props["training"]["properties"]["seed"]["maximum"] == 2**32 - 1
    assert props["runPolicy"]["properties"]["activeDeadlineSeconds"]["maximum"] == 315_360_000
    quantity = props["trainer"]["properties"]["resources"]["properties"]["limits"]
    assert quantity["additionalProperties"]["maximum"] == 2**63 - 1


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
        ("training", {**out, "outputDir": "/outputs"}),
        ("training", {**out, "outputDir": "/outputs/a/b"}),
        ("training", {**out, "outputDir": "/outputsx"}),
        ("training", {**out, "outputDir": "/workspace/output"}),
        ("training", {"volume": {"claimName": "o", "mountPath": "/workspace/output"}}),
        ("training", {"volume": {"claimName": "o", "mountPath": "/workspace/"}}),
        ("training", {"volume": {"claimName": "o", "mountPath": "/"}}),
        ("reward", {"entrypoint": "pkg.mod:fn"}),
        ("reward", {"entrypoint": "pkg.mod:fn", "service": {"url": "http://rm:8000"}}),
        ("reward", {"function": "exact_match", "service": {}}),
        ("reward", {}),
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
    ]  # fmt: skip
    for i, (section, value) in enumerate(patches):
        doc = copy.deepcopy(base)
        doc["spec"][section] = value
        yield f"variant-{i}-{section}", doc
    for name in ("a", "ab-1", "1abc", "Upper", "x" * 40, "x" * 41, "trailing-"):
        doc = copy.deepcopy(base)
        doc["metadata"]["name"] = name
        yield f"name-{name[:12]}", doc


CASES = list(itertools.chain(_docs(), _variants()))


@pytest.mark.parametrize(("name", "doc"), CASES, ids=[c[0] for c in CASES])
def test_crd_and_models_agree(validator: CrdValidator, name: str, doc: dict):
    pydantic_ok = not check_manifest(doc, crd_only=True)
    verdict = validator.validate(doc)
    assert verdict.accepted == pydantic_ok, (
        f"{name}: pydantic {'accepts' if pydantic_ok else 'rejects'} but the CRD "
        f"{'accepts' if verdict.accepted else 'rejects'}: {verdict}"
    )


def test_bad_examples_cover_every_cel_rule(validator: CrdValidator):
    violated = set()
    for _, doc in _docs():
        violated |= {rule for _, rule in validator.validate(doc).rule_failures}
    assert set(validator.all_rules()) == violated


def test_both_sides_are_exercised():
    verdicts = [not check_manifest(doc) for _, doc in CASES]
    assert verdicts.count(True) >= 10 and verdicts.count(False) >= 25


def test_the_ppo_fields_and_their_rules_are_in_the_crd():
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    critic = spec["properties"]["critic"]["properties"]
    assert {"lora", "optim", "valueClip", "warmupSteps", "vfCoef"} == set(critic)
    assert (critic["valueClip"]["default"], critic["warmupSteps"]["default"]) == (0.5, 0)
    assert critic["optim"]["properties"]["gradClip"]["default"] == 1.0
    kl = spec["properties"]["algorithm"]["properties"]["kl"]
    assert kl["properties"]["inReward"]["default"] is False
    assert kl["properties"]["controller"]["enum"] == ["fixed", "adaptive"]
    assert (kl["properties"]["targetKl"]["default"], kl["properties"]["horizon"]["default"]) == (
        0.1, 10000,
    )  # fmt: skip
    paths = {r.get("fieldPath") for r in kl["x-kubernetes-validations"]}
    assert {".inReward", ".controller", ".targetKl", ".horizon"} <= paths
    spec_paths = {r.get("fieldPath") for r in spec["x-kubernetes-validations"]}
    assert {".critic", ".critic.warmupSteps"} <= spec_paths
    algorithm_rules = spec["properties"]["algorithm"]["x-kubernetes-validations"]
    assert not any("'ppo'" in r["rule"] and r.get("fieldPath") == ".name" for r in algorithm_rules)
