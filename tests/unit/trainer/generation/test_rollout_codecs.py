"""Engine wire codecs against hand-written responses in each engine's documented format."""

from __future__ import annotations

import asyncio
import json

import pytest

from lorarl.trainer.generation.client import EndpointState, RolloutClient, pick_endpoint
from lorarl.trainer.generation.types import Sample, SamplingParams, WireFormatError, check_prompts
from lorarl.trainer.generation.wire import (
    build_sglang_generate_request,
    build_vllm_completion_request,
    parse_sglang_generate_response,
    parse_vllm_completion_response,
    version_from_label,
    version_from_model_name,
)

EP = "http://rollout-0.job:8000"

# What vLLM's OpenAI server answers to n=2, logprobs=0, return_tokens_as_token_ids=true for an
# adapter served as "policy-v7" (choices deliberately out of order; text_offset grows by the
# length of the "token_id:N" strings, as vLLM computes it).
VLLM_RESPONSE = json.loads("""
{
  "id": "cmpl-5b1c0e9f", "object": "text_completion", "created": 1735689600,
  "model": "policy-v7",
  "choices": [
    {"index": 1, "text": "12",
     "logprobs": {"text_offset": [0, 11, 22],
                  "token_logprobs": [-0.25, -1.5, -0.0625],
                  "tokens": ["token_id:5", "token_id:6", "token_id:2"],
                  "top_logprobs": [{"token_id:5": -0.25}, {"token_id:6": -1.5},
                                   {"token_id:2": -0.0625}]},
     "finish_reason": "stop", "stop_reason": null, "prompt_logprobs": null},
    {"index": 0, "text": "7+8",
     "logprobs": {"text_offset": [0, 11, 22],
                  "token_logprobs": [-2.0, -0.5, -9999.0],
                  "tokens": ["token_id:11", "token_id:66", "token_id:12"],
                  "top_logprobs": [{"token_id:11": -2.0}, {"token_id:66": -0.5},
                                   {"token_id:12": -9999.0}]},
     "finish_reason": "length", "stop_reason": null, "prompt_logprobs": null}
  ],
  "usage": {"prompt_tokens": 4, "total_tokens": 10, "completion_tokens": 6}
}
""")

# SGLang 0.5.x /generate with n=2 on one input: a list of two objects.
SGLANG_RESPONSE = json.loads("""
[
  {"text": "12", "output_ids": [5, 6, 2],
   "meta_info": {"id": "a1", "finish_reason": {"type": "stop", "matched": 2},
                 "prompt_tokens": 4, "completion_tokens": 3, "cached_tokens": 0,
                 "weight_version": "12",
                 "input_token_logprobs": [[null, 9, null]],
                 "output_token_logprobs": [[-0.25, 5, null], [-1.5, 6, null],
                                           [-0.0625, 2, null]],
                 "e2e_latency": 0.05}},
  {"text": "7+8", "output_ids": [11, 66, 12],
   "meta_info": {"id": "a2", "finish_reason": {"type": "length", "length": 3},
                 "prompt_tokens": 4, "completion_tokens": 3, "cached_tokens": 4,
                 "weight_version": "12",
                 "output_token_logprobs": [[-2.0, 11, null], [-0.5, 66, null],
                                           [-3.0, 12, null]]}}
]
""")

PROMPT = [1, 7, 8, 9]


def _vllm(body: object, n: int = 2, expected: int = 3) -> list[Sample]:
    return parse_vllm_completion_response(
        body, prompt_ids=PROMPT, n=n, endpoint=EP, expected_version=expected
    )


def _sglang(body: object, n: int = 2, expected: int = 3, lora: str | None = None) -> list[Sample]:
    return parse_sglang_generate_response(
        body, prompt_ids=PROMPT, n=n, endpoint=EP, expected_version=expected, lora_name=lora
    )


def _copy(obj: object) -> object:
    return json.loads(json.dumps(obj))


# ------------------------------------------------------------------------------------ vLLM


def test_build_vllm_request_is_exact_json() -> None:
    params = SamplingParams(
        max_tokens=32, temperature=0.7, top_p=0.9, top_k=20, seed=11, stop_token_ids=(2, 3)
    )
    body = build_vllm_completion_request([1, 7, 8], 4, params, model="policy-v3")
    assert json.loads(json.dumps(body)) == {
        "model": "policy-v3",
        "prompt": [1, 7, 8],
        "n": 4,
        "max_tokens": 32,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 11,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": True,
        "stop_token_ids": [2, 3],
        "include_stop_str_in_output": False,
    }


def test_build_vllm_request_leaves_unset_options_to_the_engine() -> None:
    body = build_vllm_completion_request([4], 1, SamplingParams(max_tokens=5), model="m")
    assert "top_k" not in body and "seed" not in body
    assert body["temperature"] == 1.0 and body["stop_token_ids"] == []


def test_parse_vllm_orders_choices_and_decodes_token_ids() -> None:
    first, second = _vllm(VLLM_RESPONSE)
    assert first == Sample(PROMPT, [11, 66, 12], [-2.0, -0.5, -9999.0], "length", 7, EP)
    assert second == Sample(PROMPT, [5, 6, 2], [-0.25, -1.5, -0.0625], "stop", 7, EP)
    assert (first.text, second.text) == ("7+8", "12")


def test_parse_vllm_without_versioned_adapter_uses_expected_version() -> None:
    body = _copy(VLLM_RESPONSE)
    body["model"] = "/models/smollm2"  # merged mode: the base model's served name
    assert {s.weight_version for s in _vllm(body, expected=41)} == {41}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b["choices"].pop(), "expected 2 choices, got 1"),
        (
            lambda b: b["choices"][0]["logprobs"]["tokens"].__setitem__(1, "6"),
            "return_tokens_as_token_ids",
        ),
        (lambda b: b["choices"][0].__setitem__("logprobs", None), "logprobs is missing"),
        (lambda b: b["choices"][1].__setitem__("finish_reason", "abort"), "aborted"),
        (lambda b: b["choices"][1].__setitem__("finish_reason", None), "finish_reason=None"),
        (lambda b: b["choices"][0]["logprobs"]["token_logprobs"].pop(), "equal length"),
        (lambda b: b["choices"][0].__setitem__("index", 0), "distinct index"),
        (
            lambda b: b["choices"][0]["logprobs"]["token_logprobs"].__setitem__(0, 0.5),
            "not a log-probability",
        ),
        (
            lambda b: b["choices"][0]["logprobs"]["token_logprobs"].__setitem__(0, None),
            "is not a number",
        ),
    ],
)
def test_parse_vllm_rejects_malformed_bodies_naming_the_field(mutate, message: str) -> None:
    body = _copy(VLLM_RESPONSE)
    mutate(body)
    with pytest.raises(WireFormatError, match=message) as info:
        _vllm(body)
    assert EP in str(info.value)


def test_parse_vllm_checks_token_ids_field_when_present() -> None:
    body = _copy(VLLM_RESPONSE)
    body["choices"][0]["token_ids"] = [5, 6, 2]
    assert _vllm(body)[1].completion_ids == [5, 6, 2]
    body["choices"][0]["token_ids"] = [5, 6]
    with pytest.raises(WireFormatError, match="token_ids disagree"):
        _vllm(body)


# ---------------------------------------------------------------------------------- SGLang


def test_build_sglang_request_is_exact_json() -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=5, stop_token_ids=(2,))
    body = build_sglang_generate_request([1, 7], 8, params, lora_name="policy-v2")
    assert json.loads(json.dumps(body)) == {
        "input_ids": [1, 7],
        "sampling_params": {
            "max_new_tokens": 16,
            "temperature": 1.0,
            "top_p": 0.95,
            "top_k": -1,
            "n": 8,
            "stop_token_ids": [2],
            "skip_special_tokens": True,
            "sampling_seed": 5,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
        "lora_path": "policy-v2",
    }
    plain = build_sglang_generate_request([1], 1, SamplingParams(max_tokens=4, top_k=3))
    assert "lora_path" not in plain and "sampling_seed" not in plain["sampling_params"]
    assert plain["sampling_params"]["top_k"] == 3


def test_parse_sglang_list_response() -> None:
    first, second = _sglang(SGLANG_RESPONSE)
    assert first == Sample(PROMPT, [5, 6, 2], [-0.25, -1.5, -0.0625], "stop", 12, EP)
    assert second == Sample(PROMPT, [11, 66, 12], [-2.0, -0.5, -3.0], "length", 12, EP)
    assert second.text == "7+8"


def test_parse_sglang_single_object_for_n1() -> None:
    (only,) = _sglang(_copy(SGLANG_RESPONSE[1]), n=1)
    assert only.completion_ids == [11, 66, 12] and only.finish_reason == "length"


@pytest.mark.parametrize(
    ("label", "lora", "expected"),
    [("default", None, 3), ("v9", None, 9), ("default", "policy-v5", 5), ("2", "policy-v5", 2)],
)
def test_parse_sglang_weight_version_sources(label: str, lora: str | None, expected: int) -> None:
    body = _copy(SGLANG_RESPONSE)
    for item in body:
        item["meta_info"]["weight_version"] = label
    assert {s.weight_version for s in _sglang(body, expected=3, lora=lora)} == {expected}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b.pop(), "expected 2 outputs, got 1"),
        (lambda b: b[0].__setitem__("output_ids", [5, 6]), "disagree"),
        (lambda b: b[0]["meta_info"].pop("output_token_logprobs"), "return_logprob"),
        (lambda b: b[1]["meta_info"].__setitem__("finish_reason", {"type": "abort"}), "aborted"),
        (
            lambda b: b[1]["meta_info"]["output_token_logprobs"].__setitem__(0, [-1.0]),
            r"\[logprob, token_id, text\]",
        ),
        (
            lambda b: b[1]["meta_info"]["output_token_logprobs"].__setitem__(0, [-1.0, "x", None]),
            "not a non-negative integer",
        ),
        (lambda b: b[0].pop("meta_info"), "meta_info is missing"),
    ],
)
def test_parse_sglang_rejects_malformed_bodies(mutate, message: str) -> None:
    body = _copy(SGLANG_RESPONSE)
    mutate(body)
    with pytest.raises(WireFormatError, match=message):
        _sglang(body)


@pytest.mark.parametrize(
    ("name", "version"),
    [
        ("policy-v7", 7),
        ("a-b-v120", 120),
        ("policy", None),
        ("policy-v", None),
        ("v7", None),
        (None, None),
    ],
)
def test_version_from_model_name(name: object, version: int | None) -> None:
    assert version_from_model_name(name) == version


@pytest.mark.parametrize(
    ("label", "version"),
    [("7", 7), ("v7", 7), (7, 7), ("default", None), (None, None), (True, None), ("7a", None)],
)
def test_version_from_label(label: object, version: int | None) -> None:
    assert version_from_label(label) == version


# ---------------------------------------------------------------------------- value types


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"max_tokens": 4, "temperature": -0.1}, "temperature"),
        ({"max_tokens": 4, "top_p": 0}, "top_p"),
        ({"max_tokens": 4, "top_k": -1}, "use None to disable"),
        ({"max_tokens": 4, "seed": -3}, "seed"),
        ({"max_tokens": 4, "stop_token_ids": (2, "x")}, r"stop_token_ids\[1\]"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sample_requires_one_logprob_per_token() -> None:
    with pytest.raises(ValueError, match="2 logprobs for 3 completion tokens"):
        Sample([1], [4, 5, 6], [-1.0, -2.0], "stop", 0, EP)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ("abc", "list of token-id lists"),
        ([[1], []], r"prompts\[1\] must be a non-empty"),
        ([[1, -2]], r"prompts\[0\]\[1\]"),
        ([[1, 2.5]], r"prompts\[0\]\[1\]"),
    ],
)
def test_check_prompts_names_the_bad_prompt(prompts: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_prompts(prompts)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- load balancing


def _states(*outstanding: int) -> list[EndpointState]:
    return [EndpointState(f"http://e{i}", outstanding=o) for i, o in enumerate(outstanding)]


def test_pick_prefers_least_outstanding() -> None:
    assert pick_endpoint(_states(3, 1, 2), tried=set(), now=0.0, rr=0) == 1


def test_pick_breaks_ties_round_robin() -> None:
    states = _states(0, 0, 0)
    picks, rr = [], 0
    for _ in range(6):
        i = pick_endpoint(states, tried=set(), now=0.0, rr=rr)
        picks.append(i)
        rr = i + 1
    assert picks == [0, 1, 2, 0, 1, 2]
    assert pick_endpoint(_states(1, 0, 0), tried=set(), now=0.0, rr=2) == 2


def test_pick_avoids_cooling_and_tried_endpoints() -> None:
    states = _states(5, 0, 0)
    states[1].cooldown_until = 10.0
    assert pick_endpoint(states, tried=set(), now=1.0, rr=1) == 2  # cooling loses despite load
    assert pick_endpoint(states, tried={2}, now=1.0, rr=0) == 0
    assert pick_endpoint(states, tried={0, 1, 2}, now=1.0, rr=0) == 2  # all tried: start over
    assert pick_endpoint(states, tried={0, 1, 2}, now=11.0, rr=0) == 1  # cooldown over


def test_pick_when_all_cool_down_takes_the_first_to_recover() -> None:
    states = _states(0, 0)
    states[0].cooldown_until, states[1].cooldown_until = 9.0, 4.0
    assert pick_endpoint(states, tried=set(), now=1.0, rr=0) == 1


# ------------------------------------------------------------------------ client arguments


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ([], {}, "non-empty list"),
        (["localhost:8000"], {}, "base URL"),
        (["http://a", "http://a/"], {}, "duplicates"),
        (["http://a"], {"engine": "tgi"}, "engine must be one of"),
        (["http://a"], {"timeout_s": 0}, "timeout_s"),
        (["http://a"], {"max_retries": -1}, "max_retries"),
        (["http://a"], {"max_concurrency_per_endpoint": 0}, "max_concurrency_per_endpoint"),
    ],
)
def test_client_rejects_bad_configuration(args: list, kwargs: dict, message: str) -> None:
    kwargs = {"engine": "vllm", "model_name": "m", **kwargs}
    engine = kwargs.pop("engine")
    with pytest.raises(ValueError, match=message):
        RolloutClient(args, engine, **kwargs)


def test_generate_validates_before_any_request() -> None:
    client = RolloutClient(["http://127.0.0.1:9"], "vllm", model_name="m")
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        client.generate([[1]], 0, params, expected_version=0)
    with pytest.raises(ValueError, match="expected_version"):
        client.generate([[1]], 1, params, expected_version=-1)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        client.generate([[]], 1, params, expected_version=0)


def test_sync_wrapper_refuses_to_run_inside_an_event_loop() -> None:
    client = RolloutClient(["http://127.0.0.1:9"], "vllm", model_name="m")

    async def call() -> None:
        client.health()

    with pytest.raises(RuntimeError, match="await the a-prefixed methods"):
        asyncio.run(call())
