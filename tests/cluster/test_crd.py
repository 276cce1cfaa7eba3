"""The generated CRD on a real kube-apiserver: accepted as kubectl and Helm send it (YAML 1.1),
served with the schema the models generate, and agreeing with the pydantic models on every
example and boundary case: the same manifests accepted (with the same defaults, nothing pruned)
and refused (with the rule's own words for every CEL rule)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.cluster.controlplane import ControlPlane
from harness.cluster.crd_cases import CASES, _docs
from harness.cluster.crd_server import CrdServer
from lorarl.api import safe_yaml
from lorarl.api.crd import crd
from lorarl.api.rules import CRD_ONLY
from lorarl.api.validation import check_manifest, validate_manifest
from tests.cluster.conftest import ROOT

# Optional integrations whose CRDs the test cluster does not install (kubectl cannot map them).
UNSERVED_GROUPS = ("cert-manager.io", "monitoring.coreos.com")


def _schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _cel_messages() -> set[str]:
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.update(r["message"] for r in node.get("x-kubernetes-validations", []))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(_schema())
    return found


def test_the_server_serves_the_generated_schema_as_written(cp_with_crd: ControlPlane):
    """kubectl read crds/ with go-yaml (YAML 1.1): had a key such as `n` been read as a boolean,
    the stored schema would differ from the generated one."""
    stored = json.loads(cp_with_crd.kubectl_ok("get", "crd", "lorarljobs.lorarl.dev", "-o", "json"))
    conditions = {c["type"]: c["status"] for c in stored["status"]["conditions"]}
    assert conditions.get("Established") == "True"
    assert conditions.get("NamesAccepted") == "True"
    served = stored["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert served == json.loads(json.dumps(_schema()))
    eval_props = served["properties"]["spec"]["properties"]["training"]["properties"]["eval"]
    assert "n" in eval_props["properties"] and "false" not in eval_props["properties"]


def test_the_dumper_quotes_what_yaml_1_1_reads_as_booleans():
    text = safe_yaml.dump({"n": 1, "y": "N", "on": "off", "no": True, "name": "n1"})
    assert "'n': 1" in text and "'y': N" not in text and "'y': 'N'" in text
    assert "'on': 'off'" in text and "'no': true" in text and "name: n1" in text
    assert yaml.safe_load(text) == {"n": 1, "y": "N", "on": "off", "no": True, "name": "n1"}


def _yaml_files() -> list[Path]:
    """Every YAML the project writes or ships for kubectl and Helm to read."""
    files = sorted(ROOT.glob("crds/*.yaml")) + sorted(ROOT.glob("charts/lorarl/crds/*.yaml"))
    files += sorted(ROOT.glob("operator/config/**/*.yaml"))
    files += sorted(ROOT.glob("examples/*.yaml")) + sorted(ROOT.glob("examples/cluster/*.yaml"))
    return [f for f in files if f.name != "kustomization.yaml"]


def test_kubectl_reads_every_yaml_we_ship_as_python_does(cp_with_crd: ControlPlane):
    """go-yaml (kubectl) and PyYAML agree on every shipped manifest: no key or value that one
    reads as a string and the other as a boolean."""
    files = _yaml_files()
    assert len(files) >= 8
    checked = 0
    for path in files:
        for text in re.split(r"^---\s*$", path.read_text(), flags=re.M):
            doc = yaml.safe_load(text)
            if not doc or doc.get("apiVersion", "").split("/")[0] in UNSERVED_GROUPS:
                continue
            done = cp_with_crd.kubectl(
                "create", "--dry-run=client", "-o", "json", "--validate=false", "-f", "-",
                input=text,
            )  # fmt: skip
            assert done.returncode == 0, f"{path}: {done.stderr}"
            read = json.loads(done.stdout)
            if "namespace" not in (doc.get("metadata") or {}):  # kubectl fills in its default
                read.get("metadata", {}).pop("namespace", None)
            assert read == json.loads(json.dumps(doc)), (
                f"{path}: {doc.get('kind')} {doc.get('metadata', {}).get('name')} reads "
                "differently in YAML 1.1"
            )
            checked += 1
    assert checked >= 20, checked


@pytest.mark.parametrize(("name", "doc"), CASES, ids=[c[0] for c in CASES])
def test_server_and_models_agree(crd_server: CrdServer, name: str, doc: dict):
    """Accepted by both or refused by both (Python-only rules aside: the webhook has those);
    an accepted job comes back with exactly pydantic's values, defaults included."""
    if not isinstance(doc, dict):
        pytest.skip("not a mapping: refused before either side sees it")
    pydantic_ok = not check_manifest(doc, crd_only=True)
    verdict = crd_server.validate(doc)
    assert verdict.accepted == pydantic_ok, (
        f"{name}: pydantic {'accepts' if pydantic_ok else 'refuses'} but the API server "
        f"{'accepts' if verdict.accepted else 'refuses'}: {verdict.message[:2000]}"
    )
    if verdict.accepted:
        job = validate_manifest(doc, CRD_ONLY)  # `lorarl validate`'s reading (cpu: 4.0 is 4)
        assert verdict.body["spec"] == job.wire()["spec"], f"{name}: defaults or pruning differ"


def _expected(path: Path) -> tuple[str, str]:
    """The bad example's first line: (field path, message without its `(got ...)` tail)."""
    first = path.read_text().splitlines()[0]
    match = re.match(r"#\s*expect:\s*(\S+?):\s+(.*)$", first)
    assert match, f"{path}: first line is not `# expect: FIELD: MESSAGE`"
    message = re.sub(r"\s*\(got .*\)$", "", match.group(2))
    return match.group(1), message


BAD = sorted((ROOT / "examples" / "bad").glob("*.yaml"))


def test_every_bad_example_is_refused_with_its_words(crd_server: CrdServer):
    """The API server refuses each bad example the CRD can judge, naming the field; a CEL rule
    is refused with the rule's own message (the words `lorarl validate` prints)."""
    cel = _cel_messages()
    refused, by_rule, python_only = 0, set(), []
    for path in BAD:
        try:
            doc = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            continue  # malformed YAML: kubectl refuses it before any server sees it
        problems = check_manifest(doc, crd_only=True) if isinstance(doc, dict) else []
        if not problems:
            python_only.append(path.name)  # judged by the webhook (tests/cluster webhook tests)
            continue
        field, message = _expected(path)
        verdict = crd_server.validate(doc)
        # 422 Invalid (schema, CEL), or 400 for a field the schema does not declare (strict).
        assert verdict.status in (400, 422), f"{path.name}: {verdict.status} {verdict.message}"
        text = verdict.message
        refused += 1
        # The expect line may quote a rule's message in part (its start).
        rule = next((m for m in sorted(cel) if m.startswith(message)), None)
        if rule is not None:  # the server evaluates every rule and reports each failure
            assert rule in text, f"{path.name}: rule message missing from {text}"
            by_rule.add(rule)
        elif field in {p.path for p in problems}:  # a schema bound: the field is named
            version = str(doc.get("apiVersion", "")).split("/")[-1]
            leaf = field.rsplit(".", 1)[-1].split("[")[0]
            named = leaf in text or (leaf == "apiVersion" and f'in version "{version}"' in text)
            assert named, f"{path.name}: {field} not named in {text}"
    assert refused >= 60, refused
    # Every CEL rule of the CRD is shown refusing at least one bad example.
    unexercised = cel - by_rule
    assert not unexercised, f"CEL rules no bad example exercises: {sorted(unexercised)}"


def test_integer_quantities_and_big_integers_are_accepted(crd_server: CrdServer):
    """Bounds are float64 on the server: 2**63 - 1 wrapped to -2**63 and refused every integer
    quantity; the bound is now the largest exactly representable integer."""
    doc = yaml.safe_load((ROOT / "examples" / "quickstart-cluster.yaml").read_text())
    doc["spec"].setdefault("trainer", {})["resources"] = {"limits": {"cpu": 4, "memory": "8Gi"}}
    doc["spec"].setdefault("data", {})["seed"] = 2**53 - 1
    verdict = crd_server.validate(doc)
    assert verdict.accepted, verdict.message
    assert verdict.body["spec"]["trainer"]["resources"]["limits"]["cpu"] == 4
    doc["spec"]["data"]["seed"] = 2**53
    assert crd_server.validate(doc).status == 422


def test_good_examples_are_the_bulk_of_the_agreement_cases():
    good = [name for name, doc in _docs() if isinstance(doc, dict) and not check_manifest(doc)]
    assert len(good) >= 5, good
