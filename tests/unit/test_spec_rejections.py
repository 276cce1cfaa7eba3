"""Fields that would be accepted and ignored are refused instead (issue 14), by the models and by
the CRD's CEL alike; what is supported is still accepted. The refusals' messages are pinned by
examples/bad (test_api, test_crd); this checks the boundaries on both sides."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from lorarl.api.crd import crd
from lorarl.api.job import LoRARLJob
from tests.support.crd_validator import CrdValidator

MINIMAL = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "j"},
    "spec": {
        "model": {"path": "/models/m"},
        "data": {"trainFiles": ["t.jsonl"]},
        "training": {"outputDir": "/out", "volume": {"claimName": "out", "mountPath": "/out"}},
    },
}


@pytest.fixture(scope="module")
def cel() -> CrdValidator:
    return CrdValidator(crd())


def with_spec(section: str, value: dict) -> dict:
    doc = copy.deepcopy(MINIMAL)
    doc["spec"].setdefault(section, {}).update(value)
    return doc


def verdicts(doc: dict, cel: CrdValidator) -> tuple[bool, bool]:
    """(pydantic accepts, the CRD accepts)."""
    try:
        LoRARLJob.model_validate(doc)
        python = True
    except ValidationError:
        python = False
    return python, cel.validate(doc).accepted


@pytest.mark.parametrize(
    ("path", "ok"),
    [
        ("/models/Qwen2.5-3B", True),
        ("./qwen", True),
        (".cache/lorarl/models/tiny", True),
        ("~/models/qwen", True),
        ("runs/models/qwen", True),  # three parts: no hub id has them
        ("Qwen/Qwen2.5-3B-Instruct", False),
        ("gpt2", False),
        ("models/qwen", False),  # reads as a hub id: write ./models/qwen
    ],
)
def test_model_path_must_be_a_folder_not_a_hub_id(path, ok, cel):
    assert verdicts(with_spec("model", {"path": path}), cel) == (ok, ok)


@pytest.mark.parametrize(
    ("section", "value", "ok"),
    [
        ("algorithm", {"gamma": 1.0, "lam": 0.95}, True),  # the defaults, spelled out
        ("algorithm", {"gamma": 0.99}, False),
        ("algorithm", {"lam": 1.0}, False),
        ("algorithm", {"name": "ppo", "gamma": 0.99}, False),  # ppo: no value model yet
        ("trainer", {"fsdp": {"reshardAfterForward": True}}, True),
        ("trainer", {"fsdp": {"reshardAfterForward": False}}, False),
        ("training", {"export": ["adapter", "merged"]}, True),
        ("training", {"export": ["merged"]}, False),
        ("training", {"export": ["gguf"]}, False),
        ("model", {"path": "/m", "trustRemoteCode": True}, True),  # passed to the trainer too
    ],
)
def test_ignored_fields_are_refused_and_supported_ones_kept(section, value, ok, cel):
    assert verdicts(with_spec(section, value), cel) == (ok, ok)


def test_chat_template_kwargs_are_kept_as_written():
    doc = with_spec("data", {"chatTemplateKwargs": {"enable_thinking": False, "x": [1]}})
    spec = LoRARLJob.model_validate(doc).spec
    assert spec.data.chat_template_kwargs == {"enable_thinking": False, "x": [1]}
    assert LoRARLJob.model_validate(LoRARLJob.model_validate(doc).wire()) == LoRARLJob(**doc)
