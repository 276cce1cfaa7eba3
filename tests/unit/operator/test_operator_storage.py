"""The operator's kopf storages copy the object more cheaply but must compute exactly what
kopf's own do: a different essence would make kopf see spec changes that never happened (or
miss real ones) and re-run or skip handlers."""

from __future__ import annotations

import copy
import json
import timeit
from pathlib import Path

import kopf
import yaml
from kopf._cogs.structs import bodies

from lorarl.operator.storage import DiffBaseStorage, ProgressStorage

ROOT = Path(__file__).resolve().parents[3]
PREFIX = "lorarl.dev"


def _body() -> dict:
    job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    job["metadata"].update(
        namespace="default",
        uid="u1",
        resourceVersion="17",
        generation=2,
        labels={"team": "a", "tier": "x"},
        annotations={
            f"{PREFIX}/kopf-managed": "yes",
            f"{PREFIX}/last-handled-configuration": '{"spec":{}}\n',
            f"{PREFIX}/materialize": '{"started":"2026-01-01T00:00:00","retries":1}',
            "other.io/kopf-managed": "yes",  # another kopf operator's storage: ignored
            "other.io/last-handled-configuration": "{}",
            "kubectl.kubernetes.io/last-applied-configuration": "{}",
            "note": "kept",
        },
        finalizers=[f"{PREFIX}/operator"],
        managedFields=[{"manager": "kubectl", "fieldsV1": {"f:spec": {"f:x": {}}}}],
    )
    job["status"] = {
        "phase": "Running",
        "step": 3,
        "conditions": [{"type": "Ready", "status": "True", "reason": "R", "message": "m"}],
    }
    return job


def _pairs() -> list[tuple[object, object]]:
    ours = DiffBaseStorage(prefix=PREFIX, key="last-handled-configuration")
    kopfs = kopf.AnnotationsDiffBaseStorage(prefix=PREFIX, key="last-handled-configuration")
    ignoring = ("spec.rollout.replicas",)
    return [
        (ours, kopfs),
        (
            DiffBaseStorage(prefix=PREFIX, ignored_fields=ignoring),
            kopf.AnnotationsDiffBaseStorage(prefix=PREFIX, ignored_fields=ignoring),
        ),
    ]


def test_diffbase_essence_is_kopfs() -> None:
    raw = _body()
    before = copy.deepcopy(raw)
    body = bodies.Body(raw)
    for ours, kopfs in _pairs():
        for extra in (None, ["status.phase"], ["status.conditions"]):
            mine = ours.build(body=body, extra_fields=extra)
            theirs = kopfs.build(body=body, extra_fields=extra)
            assert json.dumps(mine) == json.dumps(theirs)  # same keys, values and order
    mine = _pairs()[0][0].build(body=body)
    assert "status" not in mine and mine["metadata"]["annotations"] == {"note": "kept"}
    assert raw == before  # nothing written through to the watched object
    mine["spec"]["rollout"]["x"] = 1  # and the essence shares nothing with it
    assert "x" not in raw["spec"]["rollout"]


def test_progress_clear_is_kopfs() -> None:
    essence = DiffBaseStorage(prefix=PREFIX).build(body=bodies.Body(_body()))
    essence["metadata"]["annotations"][f"{PREFIX}/materialize"] = "{}"
    before = copy.deepcopy(essence)
    mine = ProgressStorage(prefix=PREFIX).clear(essence=essence)
    theirs = kopf.AnnotationsProgressStorage(prefix=PREFIX).clear(essence=essence)
    assert json.dumps(mine) == json.dumps(theirs)
    assert f"{PREFIX}/materialize" not in mine["metadata"]["annotations"]
    assert essence == before


def test_build_is_cheaper_than_kopfs() -> None:
    body = bodies.Body(_body())
    ours, kopfs = _pairs()[0]
    mine = min(timeit.repeat(lambda: ours.build(body=body), number=50, repeat=5))
    theirs = min(timeit.repeat(lambda: kopfs.build(body=body), number=50, repeat=5))
    assert mine < theirs, (mine, theirs)
