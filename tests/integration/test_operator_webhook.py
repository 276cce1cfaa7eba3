"""The validating webhook, served by the operator over TLS and called by the API server on
`kubectl apply`: the same problems as `lorarl validate`, and no edits to a running job."""

from __future__ import annotations

import copy
import re
from typing import Any

import httpx
import yaml

from lorarl.api.validation import check_manifest
from tests.integration.test_operator_harness import ROOT, Cluster, quickstart, shared

__all__ = ["shared"]


def test_bad_manifest_is_refused_with_the_field_named(shared: Cluster) -> None:
    """The CRD's schema and CEL refuse what they can judge; the webhook, called by the API
    server, refuses the rest (Python-only rules) in the same words as `lorarl validate`."""
    refused = shared.kube.kubectl("apply", "-f", str(ROOT / "examples/bad/rank-zero.yaml"))
    assert refused.returncode == 1
    assert "spec.lora.rank: Invalid value: 0" in refused.stderr  # the schema's minimum
    name = yaml.safe_load((ROOT / "examples/bad/rank-zero.yaml").read_text())["metadata"]["name"]
    assert shared.job(name) is None

    reserved = shared.kube.kubectl("apply", "-f", str(ROOT / "examples/bad/reserved-env.yaml"))
    assert reserved.returncode == 1
    assert "spec.trainer.env" in reserved.stderr and "reserved" in reserved.stderr  # CEL

    unknown = quickstart("unknown-reward", reward={"function": "no_such_reward"})
    refused = shared.kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(unknown))
    assert refused.returncode == 1
    assert 'admission webhook "validate.lorarljobs.lorarl.dev" denied the request' in refused.stderr
    assert "spec.reward.function: " in refused.stderr and "no_such_reward" in refused.stderr
    assert shared.job("unknown-reward") is None


def test_running_job_rejects_spec_edits_but_allows_scale_and_suspend(shared: Cluster) -> None:
    manifest = quickstart("frozen")
    applied = shared.kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    assert applied.returncode == 0, applied.stderr
    shared.wait_pods("frozen", {"frozen-trainer-0", "frozen-rollout-0", "frozen-rollout-1"})

    edited = quickstart("frozen", lora={"rank": 16, "alpha": 16})
    refused = shared.kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(edited))
    assert refused.returncode == 1
    assert "spec.lora.rank: cannot be changed on a running job" in refused.stderr
    assert shared.job("frozen")["spec"]["lora"]["rank"] == 8

    scaled = shared.kube.kubectl(
        "patch", "lrj", "frozen", "--type=merge", "-p", '{"spec":{"rollout":{"replicas":1}}}'
    )
    assert scaled.returncode == 0, scaled.stderr
    shared.wait_pods("frozen", {"frozen-trainer-0", "frozen-rollout-0"})

    # Suspended, the spec may change (Kueue does this; the model and the adapter's shape only
    # until the job has begun: admission.FIXED_ONCE_BEGUN); pods are rendered anew on resume.
    for patch in (
        '{"spec":{"runPolicy":{"suspend":true}}}',
        '{"spec":{"lora":{"dropout":0.125}}}',
        '{"spec":{"runPolicy":{"suspend":false}}}',
    ):
        done = shared.kube.kubectl("patch", "lrj", "frozen", "--type=merge", "-p", patch)
        assert done.returncode == 0, (patch, done.stderr)
    shared.wait_pods("frozen", {"frozen-trainer-0", "frozen-rollout-0"})
    config = shared.kube.get("v1/configmaps", shared.namespace, "frozen-config")
    assert "dropout: 0.125" in config["data"]["job.yaml"]


def test_a_second_live_job_in_one_output_folder_is_refused(shared: Cluster) -> None:
    """The webhook lists the namespace's jobs from the API server (issue 34, finding 4): a job
    whose outputDir is another live job's is refused, naming that job, and never stored."""
    first = quickstart("out-first")
    applied = shared.kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(first))
    assert applied.returncode == 0, applied.stderr
    folder = first["spec"]["training"]["outputDir"]
    second = quickstart("out-second", training__outputDir=folder)
    refused = shared.kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(second))
    assert refused.returncode == 1
    assert 'spec.training.outputDir: overlaps the outputDir of live job "out-first"' in (
        refused.stderr
    )
    assert shared.job("out-second") is None
    own = quickstart("out-second")  # a folder of its own
    applied = shared.kube.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(own))
    assert applied.returncode == 0, applied.stderr
    shared.kube.kubectl("delete", "lrj", "out-first", "--wait=false")


def _review(obj: dict[str, Any], subresource: str | None) -> dict[str, Any]:
    """A review as the API server sends it: `subResource` only for a subresource write. The
    old object differs in its spec (rank 8): an update that leaves spec and labels alone is
    admitted without validation (metadata only, see admission.user_fields_changed)."""
    old = copy.deepcopy(obj)
    old["spec"]["lora"]["rank"] = 8
    request: dict[str, Any] = {
        "uid": "review-1",
        "kind": {"group": "lorarl.dev", "version": "v1alpha1", "kind": "LoRARLJob"},
        "resource": {"group": "lorarl.dev", "version": "v1alpha1", "resource": "lorarljobs"},
        "name": obj["metadata"]["name"],
        "namespace": "ns",
        "operation": "UPDATE",
        "userInfo": {"username": "someone"},
        "object": obj,
        "oldObject": old,
    }
    if subresource:
        request["subResource"] = subresource
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def test_webhook_validates_the_main_resource_and_lets_status_writes_through(
    shared: Cluster,
) -> None:
    """Registered without `subresource`, the validator sees main-resource reviews (no
    `subResource` field) and is skipped for status/scale writes, which carry no user spec."""
    bad = yaml.safe_load((ROOT / "examples/bad/rank-zero.yaml").read_text())
    answers = {
        sub: httpx.post(shared.webhook_url, json=_review(bad, sub), verify=False, timeout=10)
        .raise_for_status()
        .json()["response"]
        for sub in (None, "status", "scale")
    }
    assert answers[None]["allowed"] is False
    assert "spec.lora.rank: must be greater than 0 (got 0)" in answers[None]["status"]["message"]
    assert answers["status"]["allowed"] is True
    assert answers["scale"]["allowed"] is True


def _as_cluster_job(doc: dict[str, Any]) -> dict[str, Any]:
    """The bad example with an output volume, as a cluster job needs: most are written for
    `lorarl validate` and would otherwise be refused by the CRD for that alone."""
    doc = copy.deepcopy(doc)
    training = doc.setdefault("spec", {}).setdefault("training", {})
    if "volume" not in training:
        training.setdefault("outputDir", "/out")
        out = training["outputDir"]
        training["volume"] = {
            "claimName": "out",
            "mountPath": out if out.startswith("/") else "/out",
        }
    return doc


def test_every_bad_example_the_crd_accepts_is_refused_by_the_webhook(shared: Cluster) -> None:
    """The rules the CRD cannot hold (Python only) reach the API server through the operator's
    webhook: each such bad example is refused there, with the words its first line expects."""
    refused = []
    for path in sorted((ROOT / "examples" / "bad").glob("*.yaml")):
        try:
            doc = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            continue
        if not isinstance(doc, dict):
            continue
        doc = _as_cluster_job(doc)
        expected = re.sub(r"\s*\(got .*\)$", "", path.read_text().splitlines()[0])
        field, _, message = expected.removeprefix("# expect:").strip().partition(": ")
        problems = {p.path for p in check_manifest(doc, cluster=True)}
        if check_manifest(doc, crd_only=True) or field not in problems:
            continue  # the CRD refuses it (tests/cluster/test_crd.py), or its fault was the volume
        done = shared.kube.kubectl(
            "apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(doc)
        )
        assert done.returncode == 1, f"{path.name} was accepted"
        assert 'admission webhook "validate.lorarljobs.lorarl.dev" denied' in done.stderr, (
            path.name,
            done.stderr,
        )
        assert field in done.stderr and message[:60] in done.stderr, (path.name, done.stderr)
        refused.append(path.name)
    # Every Python-only rule with a bad example, by name (a skip of them all cannot pass).
    assert {
        "environment-unknown-tool.yaml",
        "environment-unknown.yaml",
        "requests-over-limits.yaml",
        "reward-params-with-external-service.yaml",
    } <= set(refused), refused
