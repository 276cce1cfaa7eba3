"""Sampling fields reach both engines' requests (issue 14 item 6): stop strings, minP,
repetitionPenalty, and maxTokens for train (data.maxResponseTokens) vs eval (training.eval).
The CRD's CEL and the models agree on the bounds and on the RL rules: repetitionPenalty needs a
rollout correction; topP < 1, topK and minP are refused for training (issue 35 item 1: the
trainer scores the full distribution) and allowed at eval."""

from __future__ import annotations

import copy
import math
import re

import pytest
from pydantic import ValidationError

from harness.cluster.crd_server import CrdServer
from lorarl.api.resource import LoRARLJob
from lorarl.api.validation import check_manifest
from lorarl.trainer.generation.sampling import eval_sampling, train_sampling
from lorarl.trainer.generation.types import SamplingParams
from lorarl.trainer.generation.wire import (
    build_sglang_generate_request,
    build_vllm_completion_request,
    parse_vllm_completion_response,
)
from lorarl.trainer.rl.overlong import truncated

MINIMAL = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "j"},
    "spec": {
        "model": {"path": "/models/m"},
        "data": {"trainFiles": ["t.jsonl"], "maxResponseTokens": 300},
        "training": {"outputDir": "/out", "volume": {"claimName": "out", "mountPath": "/out"}},
    },
}


@pytest.fixture(scope="module")
def cel(crd_server: CrdServer) -> CrdServer:
    """The CRD's side: the real API server's verdict."""
    return crd_server


def doc_with(sampling: dict | None = None, correction: str | None = None, **training) -> dict:
    doc = copy.deepcopy(MINIMAL)
    if sampling is not None:
        doc["spec"]["rollout"] = {"sampling": sampling}
    if correction is not None:
        doc["spec"]["algorithm"] = {"rolloutCorrection": {"mode": correction}}
    doc["spec"]["training"].update(training)
    if "eval" in training:  # eval settings need evals on, and those validation prompts
        doc["spec"]["training"].setdefault("evalBeforeTrain", True)
        doc["spec"]["data"]["valFiles"] = ["v.jsonl"]
    return doc


def verdicts(doc: dict, cel: CrdServer) -> tuple[bool, bool]:
    """(pydantic accepts, the CRD accepts)."""
    try:
        LoRARLJob.model_validate(doc)
        python = True
    except ValidationError:
        python = False
    return python, cel.validate(doc).accepted


# ----------------------------------------------------------------------------- the API fields


@pytest.mark.parametrize(
    ("sampling", "correction", "ok"),
    [
        ({"repetitionPenalty": 1.1, "stop": ["\n\n", "</answer>"]}, None, True),
        ({"repetitionPenalty": 1.1}, "mask-token", True),
        ({"repetitionPenalty": 1.1}, "off", False),  # nothing would weigh the changed distribution
        ({"repetitionPenalty": 0.9}, "off", False),
        ({"minP": 0.0, "repetitionPenalty": 1.0, "stop": ["\n\n"]}, "off", True),  # no change
        # Truncation filters are refused for training with every correction mode: the trainer
        # scores the full softmax(z / T), no weight can bring back the cut support.
        ({"minP": 0.05}, None, False),
        ({"minP": 0.05}, "mask-token", False),
        ({"minP": 0.05}, "off", False),
        ({"topP": 0.9}, None, False),
        ({"topP": 0.4}, "mask-sequence", False),
        ({"topP": 0.99}, "off", False),
        ({"topK": 20}, "tis", False),
        ({"topK": 1}, "off", False),
        ({"topP": 1.0, "topK": -1, "minP": 0.0}, "off", True),  # the exact settings, spelled out
        ({"topP": 1, "topK": 0, "temperature": 0.7}, "tis", True),  # topK 0 is off too
        ({"minP": 1.5}, None, False),
        ({"minP": -0.1}, None, False),
        ({"repetitionPenalty": 0.0}, None, False),
        ({"repetitionPenalty": 2.5}, None, False),  # SGLang refuses above 2
        ({"stop": [""]}, None, False),
        ({"stop": ["x" * 257]}, None, False),
        ({"stop": [f"s{i}" for i in range(33)]}, None, False),  # SGLang takes at most 32
        ({"stop": "\n\n"}, None, False),  # one string, not a list
    ],
)
def test_train_sampling_bounds_and_rule(sampling, correction, ok, cel) -> None:
    assert verdicts(doc_with(sampling, correction), cel) == (ok, ok)


def test_the_rule_names_the_fields_and_the_way_out() -> None:
    problems = check_manifest(doc_with({"repetitionPenalty": 1.2}, "off"), cluster=False)
    assert [p.path for p in problems] == ["spec.rollout.sampling.repetitionPenalty"]
    assert "rolloutCorrection" in problems[0].message


@pytest.mark.parametrize(
    ("sampling", "field", "value"),
    [
        ({"topP": 0.9}, "topP", "0.9"),
        ({"topK": 50}, "topK", "50"),
        ({"minP": 0.1}, "minP", "0.1"),
    ],
)
@pytest.mark.parametrize("correction", ["tis", "mask-token", "mask-sequence", "off"])
def test_truncating_filters_are_refused_for_training_naming_the_field(
    sampling, field, value, correction
) -> None:
    """Issue 35 #1: vLLM reports logprobs of the truncated distribution, the trainer scores the
    full softmax(z / T): with tis every token was scaled by the kept mass, a mask dropped most
    tokens. No correction mode makes that exact, so the field is refused with its name."""
    problems = check_manifest(doc_with(sampling, correction), cluster=False)
    assert len(problems) == 1, problems
    assert problems[0].path == f"spec.rollout.sampling.{field}"
    assert "for training" in problems[0].message and "full softmax" in problems[0].message
    assert f"(got {value})" in problems[0].message


def test_the_exact_settings_pass_with_every_correction_mode() -> None:
    for correction in ("tis", "mask-token", "mask-sequence", "off"):
        doc = doc_with({"temperature": 0.7, "topP": 1.0, "topK": -1, "minP": 0.0}, correction)
        assert check_manifest(doc, cluster=False) == []
        spec = LoRARLJob.model_validate(doc).spec
        params = train_sampling(spec, eos_token_id=2)
        assert (params.top_p, params.top_k, params.min_p) == (1.0, None, 0.0)


@pytest.mark.parametrize(
    ("eval_", "ok"),
    [
        ({"topP": 0.9, "minP": 0.1, "repetitionPenalty": 1.3, "maxTokens": 64}, True),
        ({"topP": 0.0}, False),
        ({"minP": 2.0}, False),
        ({"repetitionPenalty": 3.0}, False),
    ],
)
def test_eval_sampling_is_free_of_the_rl_rule_but_bounded(eval_, ok, cel) -> None:
    # Eval samples are never trained on: top-p, min-p and penalties are fine, with any correction.
    assert verdicts(doc_with(None, "off", eval=eval_), cel) == (ok, ok)


def test_float_fields_refuse_nan_and_inf() -> None:
    for field in ("minP", "repetitionPenalty"):
        for bad in (math.nan, math.inf):
            with pytest.raises(ValidationError, match=field):
                LoRARLJob.model_validate(doc_with({field: bad}))


# ------------------------------------------------------------- spec -> engine request bodies


def _spec():
    doc = doc_with(
        {"temperature": 0.8, "repetitionPenalty": 1.2, "stop": ["\n\n", "</answer>"]},
        eval={"n": 4, "temperature": 0.6, "topP": 0.9, "minP": 0.1, "repetitionPenalty": 1.05,
              "maxTokens": 64},
    )  # fmt: skip
    return LoRARLJob.model_validate(doc).spec


def test_train_and_eval_settings_reach_the_vllm_body() -> None:
    spec = _spec()
    train = train_sampling(spec, eos_token_id=2)
    body = build_vllm_completion_request([1, 5], 4, train, model="m")
    assert body["max_tokens"] == 300  # data.maxResponseTokens
    assert (body["temperature"], body["top_p"]) == (0.8, 1.0)  # training: the full distribution
    assert "min_p" not in body and "top_k" not in body and body["repetition_penalty"] == 1.2
    assert body["stop"] == ["\n\n", "</answer>"] and body["stop_token_ids"] == [2]
    assert body["include_stop_str_in_output"] is False
    assert body["seed"] == spec.training.seed

    ev = build_vllm_completion_request([1, 5], 4, eval_sampling(spec, train), model="m")
    assert ev["max_tokens"] == 64  # training.eval.maxTokens
    assert (ev["temperature"], ev["top_p"], ev["min_p"], ev["repetition_penalty"]) == (
        0.6, 0.9, 0.1, 1.05,
    )  # fmt: skip
    assert ev["stop"] == ["\n\n", "</answer>"] and ev["stop_token_ids"] == [2]  # the task's format


def test_train_and_eval_settings_reach_the_sglang_body() -> None:
    spec = _spec()
    train = train_sampling(spec, eos_token_id=2)
    sp = build_sglang_generate_request([1, 5], 4, train)["sampling_params"]
    assert sp["max_new_tokens"] == 300
    assert (sp["top_p"], sp["top_k"]) == (1.0, -1) and "min_p" not in sp
    assert (sp["repetition_penalty"], sp["stop"]) == (1.2, ["\n\n", "</answer>"])
    assert "no_stop_trim" not in sp  # SGLang's default: the stop string is cut from the text
    ev = build_sglang_generate_request([1, 5], 4, eval_sampling(spec, train))["sampling_params"]
    assert (ev["max_new_tokens"], ev["temperature"], ev["top_p"]) == (64, 0.6, 0.9)
    assert (ev["min_p"], ev["repetition_penalty"], ev["stop"]) == (0.1, 1.05, sp["stop"])


def test_eval_max_tokens_defaults_to_the_train_limit() -> None:
    spec = LoRARLJob.model_validate(doc_with()).spec
    train = train_sampling(spec, eos_token_id=None)
    assert eval_sampling(spec, train).max_tokens == train.max_tokens == 300
    assert train.stop_token_ids == () and train.stop == ()


def test_defaults_send_no_extra_fields() -> None:
    """An untouched spec keeps the engines' defaults: the new keys are absent, not zeroed."""
    spec = LoRARLJob.model_validate(doc_with()).spec
    params = train_sampling(spec, eos_token_id=2)
    vllm = build_vllm_completion_request([1], 1, params, model="m")
    sglang = build_sglang_generate_request([1], 1, params)["sampling_params"]
    for body in (vllm, sglang):
        assert not {"stop", "min_p", "repetition_penalty"} & set(body)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stop": "abc"}, "stop"),
        ({"stop": ("ok", "")}, "stop[1]"),
        ({"stop": (3,)}, "stop[0]"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(field) + " "):
        SamplingParams(max_tokens=4, **kwargs)


def test_a_stop_string_ending_is_not_counted_as_truncated() -> None:
    """vLLM cuts the stop string from `text` but returns the tokens that formed it: the sample
    trains on all of them, and only "length" counts as cut for the overlong handling."""
    body = {
        "model": "m",
        "choices": [
            {"index": 0, "text": "7+8=15", "finish_reason": "stop",
             "logprobs": {"tokens": ["token_id:11", "token_id:12", "token_id:13"],
                          "token_logprobs": [-0.1, -0.2, -0.3]}},
            {"index": 1, "text": "7+8=", "finish_reason": "length",
             "logprobs": {"tokens": ["token_id:11", "token_id:14"],
                          "token_logprobs": [-0.1, -0.4]}},
        ],
    }  # fmt: skip
    stopped, cut = parse_vllm_completion_response(
        body, prompt_ids=[1], n=2, endpoint="e", expected_version=0
    )
    assert stopped.completion_ids == [11, 12, 13] and stopped.logprobs == [-0.1, -0.2, -0.3]
    assert truncated([stopped.finish_reason, cut.finish_reason]).tolist() == [False, True]
