"""Our SGLang flags and payloads, judged by SGLang 0.5.23's own code (docs/architecture.md#testing).

Launch flags go through SGLang's `ServerArgs` parser; every body we send goes through SGLang's
real FastAPI routes (parsing, 400 handler, API-key middleware) and, statically, against the
route's own request type. SGLang *ignores* unknown top-level fields, so a misspelled field would
silently do nothing: the static check is what catches it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import httpx
import pytest
import torch

from lorarl.api import LoRARLJob
from lorarl.plan.engines import SERVED_MODEL_NAME, sglang_command
from lorarl.rollout.engine import EngineError
from lorarl.rollout.sglang_engine import SGLangEngine
from lorarl.trainer.generation.types import SamplingParams
from lorarl.trainer.generation.wire import build_sglang_generate_request
from tests.contract.conftest import Harness

BASE = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "job", "namespace": "ml"},
    "spec": {"model": {"path": "/models/m"}, "data": {"trainFiles": ["t.jsonl"]}},
}
LAUNCH = ["python", "-m", "sglang.launch_server"]


def job_spec(**spec: Any):
    doc = copy.deepcopy(BASE)
    for key, value in spec.items():
        doc["spec"].setdefault(key, {}).update(value)
    return LoRARLJob.model_validate(doc).spec


def server_args(sglang: Harness, spec, fields: list[str]) -> dict[str, Any]:
    argv = sglang_command(spec, "/models/m", "0.0.0.0", 30000)
    assert argv[:3] == LAUNCH
    answer = sglang.server_args(argv[3:], fields)
    assert "error" not in answer, f"SGLang's parser refused {argv[3:]}: {answer['error']}"
    return answer["fields"]


def assert_clean(sglang: Harness, path: str, body: Any) -> dict[str, Any]:
    result = sglang.check(path, body)
    assert (result["unknown"], result["missing"], result["errors"]) == ([], [], []), result
    return result


def raw_since(sglang: Harness, mark: int) -> list[dict[str, Any]]:
    return sglang.raw()[mark:]


# ------------------------------------------------------------------------------ launch flags


def test_merged_job_flags(sglang: Harness) -> None:
    spec = job_spec(
        model={"dtype": "bfloat16"},
        rollout={"memoryFraction": 0.7},
        training={"seed": 11},
    )
    f = server_args(sglang, spec, ["model_path", "served_model_name", "host", "port", "dtype",
                                   "tp_size", "mem_fraction_static", "random_seed", "enable_lora",
                                   "trust_remote_code"])  # fmt: skip
    assert f == {
        "model_path": "/models/m",
        "served_model_name": SERVED_MODEL_NAME,
        "host": "0.0.0.0",
        "port": 30000,
        "dtype": "bfloat16",
        "tp_size": 1,
        "mem_fraction_static": 0.7,
        "random_seed": 11,
        "enable_lora": None,
        "trust_remote_code": False,
    }


def test_adapter_job_all_linear_flags(sglang: Harness) -> None:
    spec = job_spec(rollout={"syncMode": "adapter"}, lora={"rank": 16, "alpha": 32})
    f = server_args(sglang, spec, ["enable_lora", "max_lora_rank", "lora_target_modules",
                                   "max_loras_per_batch"])  # fmt: skip
    assert f == {
        "enable_lora": True,
        "max_lora_rank": 16,
        "lora_target_modules": ["all"],
        "max_loras_per_batch": 2,
    }


def test_adapter_job_tp2_trust_remote_code_flags(sglang: Harness) -> None:
    spec = job_spec(
        model={"trustRemoteCode": True, "dtype": "float16"},
        rollout={"syncMode": "adapter", "gpusPerReplica": 2, "tensorParallelSize": 2},
        lora={"rank": 8, "targetModules": ["q_proj", "v_proj", "down_proj"]},
    )
    f = server_args(sglang, spec, ["tp_size", "trust_remote_code", "dtype", "enable_lora",
                                   "max_lora_rank", "lora_target_modules"])  # fmt: skip
    assert f == {
        "tp_size": 2,
        "trust_remote_code": True,
        "dtype": "float16",
        "enable_lora": True,
        "max_lora_rank": 8,
        "lora_target_modules": ["q_proj", "v_proj", "down_proj"],
    }


def test_engine_args_pass_through(sglang: Harness) -> None:
    # Flags lorarl sets (--api-key, ...) are refused by the spec (tests/security).
    extra = ["--stream-interval", "2", "--context-length", "4096", "--chunked-prefill-size", "1024"]
    spec = job_spec(rollout={"engineArgs": extra})
    f = server_args(sglang, spec, ["stream_interval", "context_length", "chunked_prefill_size"])
    assert f == {"stream_interval": 2, "context_length": 4096, "chunked_prefill_size": 1024}


def test_parser_rejects_what_sglang_does_not_know(sglang: Harness) -> None:
    """The check has teeth: a misspelled flag and a PEFT-only target name both fail to parse."""
    typo = sglang.server_args(["--model-path", "/m", "--tp-sze", "2"], ["tp_size"])
    assert "unrecognized arguments: --tp-sze" in typo["error"]
    spec = job_spec(rollout={"syncMode": "adapter"}, lora={"targetModules": ["c_attn"]})
    argv = sglang_command(spec, "/models/m", "0.0.0.0", 30000)
    refused = sglang.server_args(argv[3:], ["lora_target_modules"])
    assert "c_attn" in refused["error"]


# -------------------------------------------------------------------------- /generate (trainer)

GENERATE_CASES = {
    "adapter-seeded": (
        [1, 2, 3],
        4,
        SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=7, stop_token_ids=(2,)),
        "policy-v3",
    ),
    "merged-top-k": ([5, 6], 1, SamplingParams(max_tokens=3, top_k=20), None),
    "stop-min-p-penalty": (
        [5, 6],
        2,
        SamplingParams(
            max_tokens=5, stop=("\n\n", "</answer>"), min_p=0.05, repetition_penalty=1.2
        ),
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(GENERATE_CASES))
def test_generate_body_builds_sglang_request(sglang: Harness, case: str) -> None:
    prompt, n, params, lora = GENERATE_CASES[case]
    body = build_sglang_generate_request(prompt, n, params, lora_name=lora)
    assert assert_clean(sglang, "/generate", body)["type"] == "GenerateReqInput"
    before = len(sglang.calls())
    resp = sglang.http.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    (call,) = sglang.calls()[before:]
    obj = call["obj"]
    assert (call["route"], call["type"]) == ("/generate", "GenerateReqInput")
    assert call["parallel_sample_num"] == n  # SGLang fans our one prompt out into n samples
    assert obj["input_ids"] == prompt and obj["return_logprob"] is True
    assert obj["logprob_start_len"] == -1 and obj["lora_path"] == lora
    sp = obj["sampling_params"]
    assert (sp["max_new_tokens"], sp["n"], sp["stop_token_ids"]) == (
        params.max_tokens,
        n,
        list(params.stop_token_ids),
    )
    assert sp["top_k"] == (params.top_k if params.top_k is not None else -1)
    assert sp.get("sampling_seed") == params.seed
    assert sp.get("stop") == (list(params.stop) or None)
    assert sp.get("min_p", 0.0) == params.min_p
    assert sp.get("repetition_penalty", 1.0) == params.repetition_penalty
    assert not sp.get("no_stop_trim")  # the stop string is cut from the text, ids are kept


@pytest.mark.parametrize(
    ("field", "value"),
    [("repetition_penalty", 2.5), ("repetition_penalty", 0.0), ("min_p", 1.5)],
)
def test_sglang_refuses_what_sampling_params_refuse(sglang: Harness, field, value) -> None:
    """Our bounds are SGLang's: a value SamplingParams refuses, SGLang's verify refuses too."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=2, **{field: value})
    body = build_sglang_generate_request([1], 1, SamplingParams(max_tokens=2))
    body["sampling_params"][field] = value
    resp = sglang.http.post("/generate", json=body)
    assert resp.status_code == 400 and field in resp.text
    body["sampling_params"][field] = 2.0 if field == "repetition_penalty" else 1.0  # the edges
    SamplingParams(max_tokens=2, **{field: body["sampling_params"][field]})
    assert sglang.http.post("/generate", json=body).status_code == 200


def test_sglang_takes_at_most_the_stop_strings_the_api_allows(sglang: Harness) -> None:
    """rollout.sampling.stop has maxItems 32: SGLang's MAX_STOP_COUNT. Stop strings need the
    engine's tokenizer, so our launch never skips loading it."""
    from lorarl.api.spec.workloads import SamplingSpec

    for spec in (job_spec(), job_spec(rollout={"syncMode": "adapter"})):
        assert "--skip-tokenizer-init" not in sglang_command(spec, "/models/m", "0.0.0.0", 1)

    limit = SamplingSpec.model_fields["stop"].metadata[0].max_length
    stops = tuple(f"s{i}" for i in range(limit))
    body = build_sglang_generate_request([1], 1, SamplingParams(max_tokens=2, stop=stops))
    assert sglang.http.post("/generate", json=body).status_code == 200
    body["sampling_params"]["stop"] = [*stops, "one-more"]
    resp = sglang.http.post("/generate", json=body)
    assert resp.status_code == 400 and "stop" in resp.text


def test_misspelled_generate_fields_are_caught(sglang: Harness) -> None:
    body = build_sglang_generate_request([1, 2], 1, SamplingParams(max_tokens=2))
    typo = {k: v for k, v in body.items() if k != "return_logprob"} | {"return_logprobs": True}
    # SGLang itself silently drops the unknown top-level field (no logprobs would come back) ...
    before = len(sglang.calls())
    assert sglang.http.post("/generate", json=typo).status_code == 200
    assert sglang.calls()[before]["obj"]["return_logprob"] is None
    # ... which the static check reports.
    assert sglang.check("/generate", typo)["unknown"] == ["return_logprobs"]
    # Sampling params are stricter: SGLang's own contract answers 400.
    bad_sp = {**body, "sampling_params": {**body["sampling_params"], "max_tokens": 2}}
    assert "sampling_params.max_tokens" in sglang.check("/generate", bad_sp)["unknown"]
    resp = sglang.http.post("/generate", json=bad_sp)
    assert resp.status_code == 400 and "max_tokens" in resp.text


def test_generate_bad_value_is_refused(sglang: Harness) -> None:
    body = build_sglang_generate_request([1], 1, SamplingParams(max_tokens=2))
    body["sampling_params"]["top_p"] = 0.0  # SamplingParams.verify: top_p must be in (0, 1]
    resp = sglang.http.post("/generate", json=body)
    assert resp.status_code == 400 and "top_p" in resp.text


# ------------------------------------------------------------------- SGLangEngine's requests


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()


def test_engine_merged_push_through_sglang_receiver(sglang: Harness) -> None:
    g = torch.Generator().manual_seed(0)
    layer = "model.layers.0"
    named = [
        (f"{layer}.self_attn.q_proj.weight", torch.randn(8, 8, generator=g).to(torch.bfloat16)),
        (f"{layer}.self_attn.k_proj.weight", torch.randn(4, 8, generator=g).to(torch.bfloat16)),
        (f"{layer}.self_attn.v_proj.weight", torch.randn(4, 8, generator=g).to(torch.bfloat16)),
        (f"{layer}.mlp.down_proj.weight", torch.randn(8, 3, generator=g)),  # float32
    ]
    mark, calls0 = len(sglang.raw()), len(sglang.calls())
    # 200-byte buckets: q (128 B) | k+v (64+64 B) in bf16, down_proj (96 B) alone in fp32.
    with SGLangEngine(sglang.url, api_key=sglang.api_key, bucket_bytes=200) as engine:
        engine.push_merged_weights(named, version=5)
        engine.push_merged_weights(named[:3], version=6)  # same group, no new init
        assert engine.weight_version == 6
        first_group = engine.group_name
        engine.reset_update_group()  # as after an engine restart
        engine.push_merged_weights(named[3:], version=7)
        assert engine.group_name not in (None, first_group)

    raw = raw_since(sglang, mark)
    routes = [r["path"] for r in raw]
    push = (
        ["/begin_weight_update"] + ["/update_weights_from_distributed"] * 3 + ["/end_weight_update"]
    )
    push6 = (
        ["/begin_weight_update"] + ["/update_weights_from_distributed"] * 2 + ["/end_weight_update"]
    )
    assert routes == [
        "/server_info", "/init_weights_update_group", *push, *push6,
        "/destroy_weights_update_group", "/init_weights_update_group",
        "/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update",
    ]  # fmt: skip
    assert all(r["status"] == 200 for r in raw), raw
    for r in raw:  # every body we sent is exactly SGLang's request type, nothing ignored
        if r["method"] == "POST":
            assert_clean(sglang, r["path"], r["body"])

    calls = sglang.calls()[calls0:]
    updates = [c for c in calls if c["route"] == "/update_weights_from_distributed"]
    received = {}
    for c in updates[:3]:
        received.update(c["received"])
    assert received == {
        name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
               "sha256": _sha(t)}
        for name, t in named
    }  # fmt: skip
    # Only the last bucket flushes and sets the label: it never names half-loaded weights.
    assert [(c["obj"]["flush_cache"], c["obj"]["weight_version"]) for c in updates] == [
        (False, None), (False, None), (True, "5"), (False, None), (True, "6"), (True, "7")
    ]  # fmt: skip
    assert {c["obj"]["load_format"] for c in updates} == {"flattened_bucket"}
    (destroy,) = [c for c in calls if c["route"] == "/destroy_weights_update_group"]
    assert destroy["obj"]["group_name"] == first_group
    inits = [c["obj"] for c in calls if c["route"] == "/init_weights_update_group"]
    assert [(i["rank_offset"], i["world_size"], i["backend"]) for i in inits] == [
        (1, 2, "gloo")
    ] * 2
    assert sglang.weight_version() == "7"


def test_engine_adapter_and_cache_requests(sglang: Harness, tmp_path) -> None:
    adapter = tmp_path / "policy-v1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8}))
    mark, calls0 = len(sglang.raw()), len(sglang.calls())
    label = sglang.weight_version()
    with SGLangEngine(sglang.url, api_key=sglang.api_key, flush_timeout=5.0) as engine:
        assert engine.health()
        engine.load_adapter(adapter, "policy-v1", version=1)
        engine.load_adapter(adapter, "policy-v1", version=2)  # already loaded: replaced
        engine.unload_adapter("policy-v1")
        engine.flush_cache()
        assert engine.weight_version == 2
        with pytest.raises(EngineError, match="policy-v9"):
            engine.unload_adapter("policy-v9")
    raw = raw_since(sglang, mark)
    assert [(r["path"], r["status"]) for r in raw] == [
        ("/health", 200),
        ("/load_lora_adapter", 200),
        ("/load_lora_adapter", 400),
        ("/unload_lora_adapter", 200),
        ("/load_lora_adapter", 200),
        ("/unload_lora_adapter", 200),
        ("/flush_cache", 200),
        ("/unload_lora_adapter", 400),
    ]
    for r in raw:
        if r["method"] == "POST" and r["path"] != "/flush_cache":
            assert_clean(sglang, r["path"], r["body"])
    assert raw[6]["query"] == "timeout=5.0" and raw[6]["body"] is None
    loads = [c["obj"] for c in sglang.calls()[calls0:] if c["route"] == "/load_lora_adapter"]
    assert {(o["lora_name"], o["lora_path"]) for o in loads} == {("policy-v1", str(adapter))}
    flush = [c for c in sglang.calls()[calls0:] if c["route"] == "/flush_cache"]
    assert flush[0]["obj"] == {"timeout_s": 5.0}
    assert sglang.weight_version() == label  # adapter mode leaves the engine-wide label alone


def test_engine_with_wrong_key_gets_a_clear_error(sglang: Harness) -> None:
    with SGLangEngine(sglang.url, api_key="wrong") as engine:
        assert engine.health()  # /health is exempt from auth (probes)
        with pytest.raises(EngineError, match="401"):
            engine.flush_cache()


# ------------------------------------------------------------ SGLang's app: 400 vs. handler


BAD_INIT = {"master_address": "h", "master_port": "x", "rank_offset": 1, "world_size": 2}


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/load_lora_adapter", {"lora_name": "a"}, "lora_path"),
        ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["bfloat16"]}, "shapes"),
        ("/init_weights_update_group", BAD_INIT, "master_port"),
    ],
)
def test_bad_body_gets_400_and_never_reaches_handler(
    sglang: Harness, path: str, body: dict, field: str
) -> None:
    before = len(sglang.calls())
    resp = sglang.http.post(path, json=body)
    assert resp.status_code == 400 and field in resp.text
    assert sglang.calls()[before:] == []
    assert field in json.dumps(sglang.check(path, body))


def test_contract_routes_need_the_key(sglang: Harness) -> None:
    resp = httpx.post(f"{sglang.url}/load_lora_adapter", json={"lora_name": "a", "lora_path": "/p"})
    assert resp.status_code == 401
