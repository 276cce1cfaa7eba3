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


def test_rollout_correction_and_dual_clip_are_on_by_default_and_can_be_turned_off():
    from lorarl.trainer.settings import loss_config

    cfg = loss_config(make())
    assert (cfg.correction, cfg.correction_threshold, cfg.dual_clip) == ("tis", 2.0, 3.0)
    off = loss_config(
        make(algorithm={"dualClip": None, "rolloutCorrection": {"mode": "off"}})
    )
    assert (off.correction, off.dual_clip) == ("off", None)
    masked = loss_config(make(algorithm={"rolloutCorrection": {"mode": "mask-token",
                                                               "threshold": 3}}))  # fmt: skip
    assert (masked.correction, masked.correction_threshold) == ("mask-token", 3.0)
    assert any("rolloutCorrection.threshold" in p
               for p in problems(algorithm={"rolloutCorrection": {"threshold": 1}}))  # fmt: skip
