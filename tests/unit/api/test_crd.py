"""The generated CRD: committed copy up to date, structurally sound, bounded. Its agreement with
the pydantic models on every example is checked on a real API server (tests/cluster/test_crd.py)."""

from __future__ import annotations

from pathlib import Path

from harness.cluster.crd_cases import CASES
from lorarl.api.crd import crd, crd_yaml
from lorarl.api.validation import check_manifest

ROOT = Path(__file__).resolve().parents[3]
CRD_PATH = ROOT / "crds" / "lorarljobs.lorarl.dev.yaml"


def test_committed_crd_matches_the_models():
    assert CRD_PATH.read_text() == crd_yaml(), "crds/ is stale: run `make crds`"


def test_crd_shape():
    version = crd()["spec"]["versions"][0]
    names = crd()["spec"]["names"]
    assert names["shortNames"] == ["lrj"] and "all" in names["categories"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.rollout.replicas"
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    default = [name for name, c in columns.items() if not c.get("priority")]
    assert default == ["Phase", "Steps", "Reward", "Eval", "Age"]
    assert list(columns)[-1] == "Age"  # last in -o wide too
    # a printer column cannot format: the operator writes steps as 12/40 and 3-digit numbers
    assert columns["Steps"]["jsonPath"] == ".status.columns.steps"
    assert columns["Reward"]["jsonPath"] == ".status.columns.reward"
    assert columns["Eval"]["jsonPath"] == ".status.columns.eval"
    assert columns["Sync"]["priority"] == 1
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
    assert quantity["additionalProperties"]["maximum"] == 2**53 - 1  # exact in float64


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


def test_status_columns_format_what_kubectl_get_prints():
    from lorarl.api.reports.status import EvalRecord, LoRARLJobStatus, StepMetrics

    status = LoRARLJobStatus(
        phase="Running", step=12, total_steps=40, metrics=StepMetrics(reward_mean=0.41236),
        eval=EvalRecord(step=10, reward_mean=0.5, accuracy=0.6666, prompts=3,
                        samples_per_prompt=1, seconds=1.0),
    ).with_columns()  # fmt: skip
    assert status.wire()["columns"] == {"steps": "12/40", "reward": "0.412", "eval": "0.667"}
    fresh = LoRARLJobStatus(total_steps=40).with_columns()
    assert fresh.wire()["columns"] == {"steps": "0/40"}


def test_the_operator_writes_the_columns_with_every_status():
    """`kubectl get lrj` reads status.columns: the reconciler's one status write fills them."""
    import asyncio
    from types import SimpleNamespace

    from lorarl.api.reports.status import LoRARLJobStatus, StepMetrics
    from lorarl.operator.config import OperatorConfig
    from lorarl.operator.reconciler import Reconciler

    patches = []

    class Kube:
        async def merge_patch(self, url, body, what):
            patches.append((url, body))

    reconciler = Reconciler(kube=Kube(), config=OperatorConfig())
    state = SimpleNamespace(body={"metadata": {"name": "j", "namespace": "ns"}})
    status = LoRARLJobStatus(
        phase="Running", step=3, total_steps=30, metrics=StepMetrics(reward_mean=0.25)
    )
    asyncio.run(reconciler._write_status(state, status))
    (url, body), = patches  # fmt: skip
    assert url.endswith("/namespaces/ns/lorarljobs/j/status")
    assert body["status"]["columns"] == {"steps": "3/30", "reward": "0.250"}
    assert state.status.columns.steps == "3/30"
