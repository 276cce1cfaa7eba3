"""The stale-policy guard's rule (`judge`), its probe wire format, and the fleet acting on it:
an engine that does not show the version is re-synced once, then named."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from lorarl.sync.protocol import adapter_name
from lorarl.sync.transport import Registration
from lorarl.trainer.fleet.membership import Fleet
from lorarl.trainer.fleet.sync_check import (
    PROBE_TOKENS,
    ProbeError,
    StalePolicy,
    SyncCheck,
    judge,
    parse_probe,
    probe_ids,
    probe_request,
)

TOL = 2e-3
V0 = [-1.0, -2.0, -0.5, -3.0]
V1 = [-0.8, -2.3, -0.4, -2.6]  # moved 0.25 per token: far more than the tolerance
NOISE = [1e-5, -2e-5, 0.0, 1e-5]


def plus(a, b):
    return [x + y for x, y in zip(a, b, strict=True)]


def test_an_engine_on_the_new_version_passes_within_noise() -> None:
    verdict = judge(plus(V1, NOISE), V1, V0, TOL)
    assert verdict.ok and verdict.gap < 1e-4 and verdict.moved == pytest.approx(0.25)


def test_an_engine_still_on_the_previous_version_fails_when_the_update_is_visible() -> None:
    verdict = judge(plus(V0, NOISE), V1, V0, TOL)
    assert not verdict.ok and verdict.reason.startswith("its probe logprobs are")
    assert verdict.gap_previous is not None and verdict.gap_previous < 1e-4


def test_an_update_that_arrived_in_part_fails_when_it_is_closer_to_the_version_before() -> None:
    """Within the tolerance of the new version, yet nearer the old: a third of the update."""
    third = [p + (n - p) / 3 for p, n in zip(V0, V1, strict=True)]
    verdict = judge(third, V1, V0, tolerance=0.2)  # gap 0.167 <= 0.2 < moved 0.25
    assert not verdict.ok and "previous version" in verdict.reason
    two_thirds = [p + 2 * (n - p) / 3 for p, n in zip(V0, V1, strict=True)]
    assert judge(two_thirds, V1, V0, tolerance=0.2).ok


def test_an_update_below_the_noise_cannot_be_seen_and_is_not_held_against_the_engine() -> None:
    tiny = [x + 1e-4 for x in V0]
    assert judge(V0, tiny, V0, TOL).ok  # samples from either are on-policy to this precision


def test_an_engine_far_from_the_version_fails_without_a_history() -> None:
    verdict = judge([x - 1.0 for x in V1], V1, None, TOL)
    assert not verdict.ok and verdict.gap == pytest.approx(1.0)


def test_non_finite_or_misaligned_answers_fail() -> None:
    assert not judge([math.nan, *V1[1:]], V1, None, TOL).ok
    assert not judge(V1[:-1], V1, None, TOL).ok


def test_the_probe_is_a_prompt_and_its_answer_cut_to_the_last_tokens() -> None:
    assert probe_ids([1, 2, 3], [4, 5]) == [1, 2, 3, 4, 5]
    long = list(range(200))
    assert probe_ids(long[:150], long[150:]) == long[-PROBE_TOKENS:]
    with pytest.raises(ValueError, match="at least 2"):
        probe_ids([7])


def test_vllm_probe_asks_for_prompt_logprobs_and_checks_the_served_name() -> None:
    path, body = probe_request("vllm", [3, 4, 5], "lorarl-v2", "lorarl-v2")
    assert path == "/v1/completions"
    assert body["prompt"] == [3, 4, 5] and body["prompt_logprobs"] == 0
    reply = {
        "model": "lorarl-v2",
        "choices": [
            {
                "prompt_logprobs": [
                    None,
                    {"4": {"logprob": -1.5, "rank": 3}, "9": {"logprob": -0.1, "rank": 1}},
                    {"5": {"logprob": -0.25}},
                ]
            }
        ],
    }
    assert parse_probe("vllm", reply, [3, 4, 5], "lorarl-v2") == [-1.5, -0.25]
    with pytest.raises(ProbeError, match="answered as model"):
        parse_probe("vllm", {**reply, "model": "lorarl-v1"}, [3, 4, 5], "lorarl-v2")
    with pytest.raises(ProbeError, match="not a prompt-logprob answer"):
        parse_probe("vllm", {"model": "lorarl-v2", "choices": [{}]}, [3, 4, 5], "lorarl-v2")


def test_sglang_probe_reads_input_token_logprobs_of_the_probe_tokens() -> None:
    path, body = probe_request("sglang", [3, 4, 5], "base", "lorarl-v2")
    assert path == "/generate" and body["logprob_start_len"] == 0
    assert body["return_logprob"] is True and body["lora_path"] == "lorarl-v2"
    assert "lora_path" not in probe_request("sglang", [3, 4], "base", None)[1]
    # SGLang's TokenizerManager.detokenize_logprob_tokens: (logprob, token id, text)
    meta = {"input_token_logprobs": [[None, 3, None], [-1.5, 4, None], [-0.25, 5, None]]}
    assert parse_probe("sglang", {"meta_info": meta}, [3, 4, 5], "base") == [-1.5, -0.25]
    other = {"input_token_logprobs": [[None, 3, None], [-1.5, 4, None], [-0.25, 6, None]]}
    with pytest.raises(ProbeError, match="not of the probe's tokens"):
        parse_probe("sglang", {"meta_info": other}, [3, 4, 5], "base")


# ---------------------------------------------------------------------- the fleet acting on it

IDS = [1, 2, 3, 4, 5]


class Engines:
    """vLLM-shaped engines behind httpx.MockTransport: each serves `serving[url]`'s logprobs,
    a re-sync moves the ones in `fixed_by_resync` to the latest version."""

    def __init__(self, versions: dict[int, list[float]]):
        self.versions = versions
        self.serving: dict[str, int] = {}
        self.fixed_by_resync: set[str] = set()
        self.probes: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/healthz":  # every sidecar says it applied the latest version
            incarnation = "a" + request.url.host.removeprefix("s")
            return httpx.Response(200, json={"version": 1, "incarnation": incarnation})
        self.probes.append(url)
        body = json.loads(request.content)
        lps = self.versions[self.serving[url]]
        entries = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(IDS[1:], lps, strict=True)]
        return httpx.Response(
            200, json={"model": body["model"], "choices": [{"prompt_logprobs": entries}]}
        )


class Publisher:
    def __init__(self, engines: Engines, members: list[Registration], latest: int):
        self.engines, self.members, self.resyncs = engines, members, 0
        self.sender = self
        self.latest_version = latest

    def registered(self) -> list[Registration]:
        return self.members

    def catch_up(self, members=None, force: bool = False) -> bool:
        if force:
            self.resyncs += 1
            for url in self.engines.fixed_by_resync:
                self.engines.serving[url] = self.latest_version
        return force


def fleet_with(
    serving: dict[str, int], fixed: set[str] = frozenset()
) -> tuple[Fleet, Engines, Publisher]:
    versions = {0: [-1.0, -2.0, -0.5, -3.0], 1: [-0.8, -2.3, -0.4, -2.6]}
    engines = Engines(versions)
    engines.serving = dict(serving)
    engines.fixed_by_resync = set(fixed)
    members = [
        Registration(i, f"a{i}", url, f"http://s{i}:1") for i, url in enumerate(sorted(serving))
    ]
    publisher = Publisher(engines, members, latest=1)
    http = httpx.Client(transport=httpx.MockTransport(engines.handle))
    guard = SyncCheck(http, "vllm", "merged", "base", tolerance=TOL)
    for v, lps in versions.items():
        guard.expect(v, IDS, lps)
    fleet = Fleet(publisher, http, initial_members=len(members), sleep=lambda s: None, guard=guard)
    return fleet, engines, publisher


def test_replicas_that_show_the_version_serve_and_are_probed_once_per_version() -> None:
    fleet, engines, publisher = fleet_with({"http://e0:1": 1, "http://e1:1": 1})
    assert set(fleet.serving()) == {"http://e0:1", "http://e1:1"}
    assert set(fleet.serving()) == {"http://e0:1", "http://e1:1"}
    assert sorted(engines.probes) == ["http://e0:1", "http://e1:1"]  # proven: not asked again
    assert publisher.resyncs == 0
    seconds, gap = fleet.guard.take_seconds()
    assert seconds > 0 and gap is not None and gap < 1e-9


def test_a_stale_engine_is_re_synced_and_serves_once_it_shows_the_version() -> None:
    fleet, _, publisher = fleet_with({"http://e0:1": 1, "http://e1:1": 0}, fixed={"http://e1:1"})
    assert set(fleet.serving()) == {"http://e0:1", "http://e1:1"}
    assert publisher.resyncs == 1


def test_an_engine_still_stale_after_the_re_sync_stops_the_step_with_its_name() -> None:
    fleet, _, publisher = fleet_with({"http://e0:1": 1, "http://e1:1": 0})
    with pytest.raises(StalePolicy, match=r"rollout-1 \(http://e1:1\) does not serve weight "
                       r"version 1 after a re-sync"):  # fmt: skip
        fleet.serving()
    assert publisher.resyncs == 1


def test_adapter_mode_probes_as_the_versioned_adapter_and_a_404_fails() -> None:
    asked: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        model = json.loads(request.content)["model"]
        asked.append(model)
        return httpx.Response(
            404, json={"error": {"message": f"The model `{model}` does not exist."}}
        )

    http = httpx.Client(transport=httpx.MockTransport(handle))
    guard = SyncCheck(http, "vllm", "adapter", "base", tolerance=TOL)
    guard.expect(3, IDS, [-1.0] * 4)
    verdict = guard.check("http://e0:1", "a0", 3, adapter_name(3))
    assert not verdict.ok and "HTTP 404" in verdict.reason and "lorarl-v3" in verdict.reason
    assert asked == ["lorarl-v3"]
    assert not guard.proven("http://e0:1", "a0", 3)
