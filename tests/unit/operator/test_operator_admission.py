"""Webhook rules: `lorarl validate`'s problems, and which fields a running job may change."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from lorarl.api.validation import check_manifest
from lorarl.operator.admission import (
    changed_paths,
    immutable_changes,
    manifest_problems,
    update_refusal,
)

ROOT = Path(__file__).resolve().parents[3]
JOB = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())


def edited(**spec: object) -> dict:
    new = copy.deepcopy(JOB)
    for dotted, value in spec.items():
        cur = new["spec"]
        *path, last = dotted.split("__")
        for key in path:
            cur = cur.setdefault(key, {})
        cur[last] = value
    return new


def test_the_same_problems_as_lorarl_validate() -> None:
    checked = 0
    for bad in sorted((ROOT / "examples" / "bad").glob("*.yaml")):
        try:
            doc = yaml.safe_load(bad.read_text())
        except yaml.YAMLError:
            continue  # kubectl refuses these before any webhook sees them
        if isinstance(doc, dict):
            checked += 1
            assert manifest_problems(doc) == check_manifest(doc), bad.name
            assert manifest_problems(doc), bad.name
    assert checked >= 20
    with_status = {**JOB, "status": {"phase": "Running", "kopf": {"x": 1}}}
    assert manifest_problems(with_status) == []


def test_the_webhook_and_the_operator_hold_a_job_to_the_cluster_rules() -> None:
    """A job whose outputs would land on the read-only root is refused at apply time and, with
    the webhook off, failed by the operator with the same words."""
    import pytest

    from lorarl.api.validation import ManifestError
    from lorarl.operator.parsing import job_from_body

    doc = copy.deepcopy(JOB)
    del doc["spec"]["training"]["volume"]
    problems = [str(p) for p in manifest_problems(doc)]
    assert len(problems) == 1 and problems[0].startswith("spec.training.volume: a cluster run")
    with pytest.raises(ManifestError) as exc:
        job_from_body(doc)
    assert [str(p) for p in exc.value.problems] == problems


def test_changed_paths_name_leaves() -> None:
    assert changed_paths({"a": {"b": 1, "c": [1]}}, {"a": {"b": 2, "c": [1, 2]}}, "spec") == [
        "spec.a.b",
        "spec.a.c",
    ]
    assert changed_paths({}, {"runPolicy": {"suspend": True}}, "spec") == ["spec.runPolicy.suspend"]
    assert changed_paths({"x": {"y": 1}}, {}, "spec") == ["spec.x.y"]


def test_running_job_may_change_only_scale_and_policy() -> None:
    assert immutable_changes(JOB, edited(rollout__replicas=5)) == []
    assert immutable_changes(JOB, edited(runPolicy__suspend=True)) == []
    assert immutable_changes(JOB, edited(runPolicy__backoffLimit=9)) == []
    assert immutable_changes(JOB, edited(lora__rank=16, rollout__engine="sglang")) == [
        "spec.lora.rank",
        "spec.rollout.engine",
    ]
    message = update_refusal(JOB, edited(lora__rank=16))
    assert message is not None and message.startswith(
        "spec.lora.rank: cannot be changed on a running job (only spec.rollout.replicas"
    )
    assert update_refusal(JOB, copy.deepcopy(JOB)) is None


def test_suspended_job_may_change_anything() -> None:
    suspended = edited(runPolicy__suspend=True)
    assert immutable_changes(suspended, edited(runPolicy__suspend=True, lora__rank=16)) == []
    # ...but not in the same write that resumes it.
    assert immutable_changes(suspended, edited(lora__rank=16)) == ["spec.lora.rank"]
