from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from lorarl.api import LoRARLJob
from lorarl.api.validation import (
    ManifestError,
    check_manifest,
    load_job_file,
    parse_job,
    validate_file,
)

ROOT = Path(__file__).resolve().parents[3]
BAD = sorted((ROOT / "examples" / "bad").glob("*.yaml"))

MINIMAL = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "minimal"},
    "spec": {
        "model": {"path": "/models/m"},
        "data": {"trainFiles": ["train.jsonl"]},
        "training": {"outputDir": "/out", "volume": {"claimName": "out", "mountPath": "/out"}},
    },
}


def test_defaults_are_what_a_lora_rl_user_expects():
    spec = LoRARLJob.model_validate(MINIMAL).spec
    lora = spec.lora.values()  # unset in the spec: an adapter's own values, else these
    assert (lora.rank, lora.alpha, lora.target_modules) == (32, 32.0, ("all-linear",))
    assert (spec.algorithm.name, spec.algorithm.group_size) == ("grpo", 8)
    assert spec.optim.lr == pytest.approx(1e-5)
    assert spec.reward.function == "math_answer"
    assert spec.rollout.sync_mode == "merged"
    assert spec.trainer.fsdp.reshard_after_forward is True  # docs/architecture.md#measured-facts


def test_round_trip_is_stable():
    job = LoRARLJob.model_validate(MINIMAL)
    again = LoRARLJob.model_validate(job.wire())
    assert again == job


def expected_message(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path.name} must start with '# expect: <message>'"
    return first.removeprefix("# expect: ")


def test_there_are_enough_bad_examples():
    assert len(BAD) >= 15


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_example_produces_its_message(path: Path):
    results = validate_file(path)
    problems = [str(p) for r in results for p in r.problems]
    assert problems, f"{path.name} was accepted"
    assert any(expected_message(path) in p for p in problems), problems


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"lora": {"rank": 1025}}, "spec.lora.rank: must be less than or equal to 1024 (got 1025)"),
        ({"optim": {"betas": [0.9]}}, "spec.optim.betas: must have at least 2 items"),
        ({"rollout": {"engine": "tgi"}}, "spec.rollout.engine: must be one of"),
        ({"training": {"totalSteps": 0}}, "spec.training.totalSteps: must be greater than 0"),
        (
            {"trainer": {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s"}}}]}},
            "spec.trainer.env[0].valueFrom.secretKeyRef.key: required field is missing",
        ),
    ],
)
def test_field_errors_name_path_rule_and_value(patch, expected):
    doc = copy.deepcopy(MINIMAL)
    doc["spec"].update(patch)
    problems = [str(p) for p in check_manifest(doc)]
    assert any(p.startswith(expected) for p in problems), problems


def test_every_problem_is_reported_not_just_the_first_field():
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["lora"] = {"rank": 0, "dropout": 2}
    doc["spec"]["algorithm"] = {"name": "nope"}
    paths = {p.path for p in check_manifest(doc)}
    assert {"spec.lora.rank", "spec.lora.dropout", "spec.algorithm.name"} <= paths


def test_group_size_one_is_fine_for_non_group_algorithms():
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["algorithm"] = {"name": "reinforce_pp", "groupSize": 1}
    assert check_manifest(doc) == []


def test_ppo_is_accepted_with_gae_settings_and_a_critic():
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["algorithm"] = {"name": "ppo", "groupSize": 1, "gamma": 0.99, "lam": 0.9}
    assert check_manifest(doc) == []
    spec = LoRARLJob.model_validate(doc).spec
    assert spec.critic is None  # unset: every default (trainer/update/ppo.py critic_settings)
    doc["spec"]["algorithm"] = {"name": "grpo", "gamma": 0.99}
    assert [p.path for p in check_manifest(doc)] == ["spec.algorithm.gamma"]


def test_non_mapping_manifest_is_rejected_clearly():
    assert [str(p) for p in check_manifest(["a"])] == ['a manifest must be a mapping (got ["a"])']


def test_multi_document_files_report_each_document(tmp_path: Path):
    good = (ROOT / "examples" / "quickstart.yaml").read_text()
    bad = (ROOT / "examples" / "bad" / "rank-zero.yaml").read_text()
    f = tmp_path / "both.yaml"
    f.write_text(good + "\n---\n" + bad)
    results = validate_file(f)
    assert [r.ok for r in results] == [True, False]
    assert results[1].source.endswith("[1]")


def test_a_cluster_run_keeps_its_outputs_on_a_claim_but_a_local_run_needs_none(tmp_path: Path):
    """A pod's root filesystem is read-only and dies with the pod: outputs need a PVC."""
    doc = copy.deepcopy(MINIMAL)
    del doc["spec"]["training"]
    assert [p.path for p in check_manifest(doc)] == ["spec.training.volume"]
    assert check_manifest(doc, cluster=False) == []
    assert parse_job(doc).spec.training.volume is None  # local run, and processes' configs
    with pytest.raises(ManifestError, match=r"spec\.training\.volume: a cluster run needs"):
        parse_job(doc, cluster=True)
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(doc))
    assert load_job_file(f).name == "minimal"
    doc["spec"]["training"] = {"volume": {"claimName": "o", "mountPath": "/out"}}
    assert [str(p) for p in check_manifest(doc)] == [
        "spec.training.outputDir: must be training.volume.mountPath or a folder under it (the "
        'rest of a pod\'s filesystem is read-only) (got "/workspace/output")'
    ]
    for ok in ("/out", "/out/", "/out/run-1"):
        doc["spec"]["training"]["outputDir"] = ok
        assert check_manifest(doc) == [], ok
    doc["spec"]["training"]["outputDir"] = "/outputs"
    assert check_manifest(doc)
