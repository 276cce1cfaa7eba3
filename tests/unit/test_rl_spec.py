"""The RL half of the spec (issue 13): what each algorithm name means, what the trainer and the
engines are told, and what is refused."""

from __future__ import annotations

import copy

from lorarl.api import LoRARLJob
from lorarl.api.validation import check_manifest
from lorarl.plan import plan

BASE = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "job", "namespace": "ml"},
    "spec": {"model": {"path": "/models/m"}, "data": {"trainFiles": ["t.jsonl"]}},
}


def doc(**spec) -> dict:
    d = copy.deepcopy(BASE)
    d["spec"].update(spec)
    return d


def make(**spec) -> LoRARLJob:
    return LoRARLJob.model_validate(doc(**spec))


def problems(**spec) -> list[str]:
    return [str(p) for p in check_manifest(doc(**spec), cluster=False)]


def test_temperature_zero_is_refused_for_training_naming_the_field():
    found = problems(rollout={"sampling": {"temperature": 0}})
    assert any(p.startswith("spec.rollout.sampling.temperature: must be > 0") for p in found), found
    assert problems(rollout={"sampling": {"temperature": 0.7}}) == []


def _engine(job: LoRARLJob):
    return plan(job).role("rollout").replicas[0].containers[0]


def test_both_engines_are_told_to_report_post_temperature_logprobs():
    vllm = _engine(make(rollout={"engine": "vllm", "gpusPerReplica": 0}))
    flag = vllm.command.index("--logprobs-mode")
    assert vllm.command[flag + 1] == "processed_logprobs"
    sglang = _engine(make(rollout={"engine": "sglang"}))
    assert sglang.env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"
