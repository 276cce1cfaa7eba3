"""The colocated release/resume of SGLang's memory, judged by SGLang 0.5.23's own code.

SGLang's `ServerArgs` parser reads the plan's argv (memory saver and weights CPU backup on for a
colocated GPU job only); lorarl's `EngineMemory` calls `/release_memory_occupation` and
`/resume_memory_occupation` through SGLang's real FastAPI app (routes, body parsing into
`ReleaseMemoryOccupationReqInput` / `ResumeMemoryOccupationReqInput`, API-key middleware) in the
harness (sglang_harness.py), whose stand-in manager keeps the scheduler's tag bookkeeping.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from lorarl.api.validation import parse_job
from lorarl.plan.engines import sglang_command
from lorarl.trainer.fleet.engine_memory import CALLS, EngineMemory, EngineMemoryError
from tests.contract.conftest import Harness

MEMORY_FIELDS = ["enable_memory_saver", "enable_weights_cpu_backup"]


def job(placement: str = "colocated", sync_mode: str = "merged"):
    return parse_job({
        "apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob", "metadata": {"name": "t"},
        "spec": {
            "model": {"path": "/m"}, "data": {"trainFiles": ["t.jsonl"]},
            "rollout": {"engine": "sglang", "placement": placement, "gpusPerReplica": 1,
                        "syncMode": sync_mode},
            "trainer": {"gpusPerReplica": 1},
        },
    })  # fmt: skip


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


def memory(sglang: Harness, http: httpx.Client, key: str | None = None) -> EngineMemory:
    return EngineMemory(
        True, "sglang", http, key or sglang.api_key, lambda: [sglang.url], attempts=1
    )


def state(sglang: Harness) -> dict:
    return sglang.http.get("/_contract/calls").json()


@pytest.mark.parametrize("sync_mode", ["merged", "adapter"])
def test_sglang_parses_the_memory_saver_flags_for_colocated_gpu_engines_only(
    sglang: Harness, sync_mode: str
) -> None:
    for placement, on in (("colocated", True), ("separate", False)):
        argv = sglang_command(job(placement, sync_mode).spec, "/models/m", "0.0.0.0", 30000)
        answer = sglang.server_args(argv[3:], MEMORY_FIELDS)
        assert "error" not in answer, answer["error"]
        assert answer["fields"] == dict.fromkeys(MEMORY_FIELDS, on)


@pytest.mark.parametrize("path", [CALLS["sglang"][0].path, CALLS["sglang"][1].path])
def test_the_bodies_lorarl_sends_are_sglangs_request_types(sglang: Harness, path: str) -> None:
    call = next(c for c in CALLS["sglang"] if c.path == path)
    result = sglang.check(path, call.body)
    kind = "Release" if "release" in path else "Resume"
    assert result == {"type": f"{kind}MemoryOccupationReqInput", "unknown": [], "missing": [],
                      "errors": []}  # fmt: skip


def test_release_then_resume_through_sglangs_routes(sglang: Harness, http: httpx.Client) -> None:
    mark, raw_mark = len(sglang.calls()), len(sglang.raw())
    mem = memory(sglang, http)
    mem.release()
    after_release = state(sglang)
    assert after_release["offload_tags"] == sorted(after_release["all_memory_types"])
    assert sorted(after_release["all_memory_types"]) == ["cuda_graph", "kv_cache", "weights"]
    mem.resume()
    assert state(sglang)["offload_tags"] == []
    made = sglang.calls()[mark:]
    assert [(c["route"], c["type"], c["obj"]["tags"]) for c in made] == [
        ("/release_memory_occupation", "ReleaseMemoryOccupationReqInput", None),
        ("/resume_memory_occupation", "ResumeMemoryOccupationReqInput", None),
    ]  # no tags: SGLang releases and resumes every memory type
    sent = sglang.raw()[raw_mark:]
    assert [(r["method"], r["path"], r["body"], r["status"]) for r in sent] == [
        ("POST", "/release_memory_occupation", {}, 200),
        ("POST", "/resume_memory_occupation", {}, 200),
    ]


def test_a_wrong_key_is_refused_and_the_release_fails(sglang: Harness, http) -> None:
    mark = len(sglang.calls())
    with pytest.raises(EngineMemoryError, match=f"{sglang.url}: HTTP 401"):
        memory(sglang, http, key="not-the-key").release()
    assert sglang.calls()[mark:] == []
    assert state(sglang)["offload_tags"] == []


def test_sglang_refuses_to_resume_memory_it_never_released(sglang: Harness, http) -> None:
    """Why only the engines lorarl released are resumed (an engine that joined mid-update)."""
    mem = memory(sglang, http)
    mem.released = [sglang.url]  # as if released, but the engine never was
    with pytest.raises(EngineMemoryError, match=r"resume of GPU memory failed .* HTTP 400"):
        mem.resume()
