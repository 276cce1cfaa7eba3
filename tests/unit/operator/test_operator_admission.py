"""Webhook rules: `lorarl validate`'s problems, and which fields a running job may change."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
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


def test_a_begun_jobs_model_cannot_change_even_suspended() -> None:
    """Its pods loaded the model (status.model: the pinned commit) and its checkpoints are
    adapters of it: resuming them on another base would load the wrong weights."""
    suspended = edited(runPolicy__suspend=True)
    other = edited(runPolicy__suspend=True, model__path="org/other")
    # not begun: anything may change while suspended
    assert immutable_changes(suspended, other) == []
    for status in (
        {"model": {"source": JOB["spec"]["model"]["path"], "revision": "a" * 40}},
        {"step": 3},
        {"checkpoint": {"step": 3, "path": "/out/step-3"}},
    ):
        begun = {**suspended, "status": status}
        assert immutable_changes(begun, other) == ["spec.model.path"], status
        message = update_refusal(begun, other)
        assert message is not None and message.startswith(
            "spec.model.path: cannot be changed once the job has begun, suspended or not"
        )
        # the rest of a suspended job's spec still may change (Kueue's edits)
        rest = edited(runPolicy__suspend=True, lora__dropout=0.1, training__totalSteps=99)
        assert immutable_changes(begun, rest) == []
        revision = edited(runPolicy__suspend=True, model__revision="v2")
        assert immutable_changes(begun, revision) == ["spec.model.revision"]
    # running and begun: the model message, not "suspend the job to edit it"
    running = {**JOB, "status": {"step": 3}}
    message = update_refusal(running, edited(model__path="org/other"))
    assert message is not None and "once the job has begun" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [("lora__rank", 16), ("lora__alpha", 7.0), ("lora__useRslora", True),
     ("lora__targetModules", ["q_proj"]), ("lora__excludeModules", ["lm_head"])],
)  # fmt: skip
def test_a_begun_jobs_adapter_shape_and_scale_cannot_change_even_suspended(field, value) -> None:
    """Its checkpoints are adapters of that rank, targets and scale: another rank or target set
    fails to load them on resume, another alpha resumes them as another policy."""
    suspended = edited(runPolicy__suspend=True)
    other = edited(runPolicy__suspend=True, **{field: value})
    path = "spec." + field.replace("__", ".")
    assert immutable_changes(suspended, other) == []  # not begun: anything goes
    begun = {**suspended, "status": {"checkpoint": {"step": 3, "path": "/out/step-3"}}}
    assert immutable_changes(begun, other) == [path]
    message = update_refusal(begun, other)
    assert message is not None and message.startswith(
        f"{path}: cannot be changed once the job has begun, suspended or not"
    ), message
    assert "adapterPath" in message
