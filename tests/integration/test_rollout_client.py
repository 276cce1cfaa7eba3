"""RolloutClient against two real HTTP engine servers (a tiny transformers model on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from harness.engines.hf_engine_server import Controls, create_app, serve_in_thread
from harness.workloads.tiny_models import make_tiny_model
from lorarl.local.ports import free_port
from lorarl.trainer.generation.client import RolloutClient, RolloutError, Sample, SamplingParams

PATHS = {"vllm": "/v1/completions", "sglang": "/generate"}
STOPS = tuple(range(40, 80))  # ~a third of the vocabulary, so many samples stop early
PROMPTS = [[1, 17, 18, 19, 20], [1, 30, 31], [1, 5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def servers(model_dir: Path) -> Iterator[list[tuple[str, Controls]]]:
    running = []
    for _ in range(2):
        app = create_app(model_dir, served_model_name="tiny", lora_names=("tiny-v7",))
        url, stop = serve_in_thread(app)
        running.append((url, app.state.controls, stop))
    yield [(url, controls) for url, controls, _ in running]
    for _, _, stop in running:
        stop()


@pytest.fixture(autouse=True)
def fresh_controls(servers: list[tuple[str, Controls]]) -> None:
    for _, controls in servers:
        controls.requests.clear()
        controls.fail_next, controls.delay_s, controls.weight_version = 0, 0.0, "default"
        controls.auth_headers.clear()


def dead_endpoint() -> str:
    """A loopback port nothing listens on (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


def client(urls: list[str], engine: str = "vllm", **kwargs: object) -> RolloutClient:
    kwargs = {"timeout_s": 30.0, "max_retries": 3, "backoff_s": 0.05, **kwargs}
    return RolloutClient(urls, engine, model_name="tiny", **kwargs)  # type: ignore[arg-type]


@torch.no_grad()
def forward_logprobs(model: torch.nn.Module, sample: Sample) -> list[float]:
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    start = len(sample.prompt_ids)
    return [float(logp[start - 1 + j, tok]) for j, tok in enumerate(sample.completion_ids)]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_samples_have_ids_and_logprobs_of_the_model(engine: str, servers, reference) -> None:
    urls = [url for url, _ in servers]
    # 4 tokens: some samples stop, some run out (both paths are checked below); with 10 every
    # sample of this seed stopped once prompts got disjoint seed ranges
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop_token_ids=STOPS)
    groups = client(urls, engine).generate(PROMPTS, 4, params, expected_version=5)
    assert [len(g) for g in groups] == [4, 4, 4]
    reasons = set()
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for s in group:
            assert s.prompt_ids == prompt and s.weight_version == 5 and s.endpoint in urls
            assert len(s.logprobs) == len(s.completion_ids) >= 1
            ends_on_stop = [t in STOPS or t == 2 for t in s.completion_ids]
            assert not any(ends_on_stop[:-1])
            if s.finish_reason == "stop":
                assert ends_on_stop[-1]
            else:
                assert len(s.completion_ids) == params.max_tokens and not ends_on_stop[-1]
            reasons.add(s.finish_reason)
            expected = forward_logprobs(reference, s)
            assert max(abs(a - b) for a, b in zip(s.logprobs, expected, strict=True)) <= 1e-4
    assert reasons == {"stop", "length"}  # both paths were exercised


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_greedy_follows_the_argmax_on_every_endpoint(engine: str, servers, reference) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    per_endpoint = [
        client([url], engine).generate([PROMPTS[0]], 2, params, expected_version=0)[0]
        for url, _ in servers
    ]
    ids = list(PROMPTS[0])
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(reference(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = ids[len(PROMPTS[0]) :]
    for group in per_endpoint:
        assert [s.completion_ids for s in group] == [greedy, greedy]


def test_seed_reproduces_samples_and_duplicate_prompts_differ(servers) -> None:
    a, b = (url for url, _ in servers)
    params = SamplingParams(max_tokens=12, seed=42)
    first = client([a]).generate([PROMPTS[1], PROMPTS[1]], 3, params, expected_version=0)
    again = client([b]).generate([PROMPTS[1], PROMPTS[1]], 3, params, expected_version=0)
    assert [[s.completion_ids for s in g] for g in first] == [
        [s.completion_ids for s in g] for g in again
    ]
    assert [s.completion_ids for s in first[0]] != [s.completion_ids for s in first[1]]


def test_weight_version_comes_from_the_engine_when_it_reports_one(servers) -> None:
    urls = [url for url, _ in servers]
    params = SamplingParams(max_tokens=3)
    vllm = client(urls).generate([PROMPTS[0]], 2, params, model="tiny-v7", expected_version=6)
    assert {s.weight_version for s in vllm[0]} == {7}
    for _, controls in servers:
        controls.weight_version = "9"
    sglang = client(urls, "sglang").generate([PROMPTS[0]], 2, params, expected_version=6)
    assert {s.weight_version for s in sglang[0]} == {9}


def test_load_spreads_over_both_endpoints(servers) -> None:
    urls = [url for url, _ in servers]
    rc = client(urls)
    groups = rc.generate(
        [[1, 10 + i] for i in range(8)], 2, SamplingParams(max_tokens=4), expected_version=0
    )
    counts = [controls.requests["/v1/completions"] for _, controls in servers]
    assert counts == [4, 4]
    assert sorted(s.endpoint for g in groups for s in g) == sorted([urls[0]] * 8 + [urls[1]] * 8)
    assert {u: st["requests"] for u, st in rc.endpoint_stats().items()} == dict.fromkeys(urls, 4)


def test_busy_endpoint_gets_the_next_request_elsewhere(servers) -> None:
    (slow, slow_controls), (fast, fast_controls) = servers
    slow_controls.delay_s = 1.0
    params = SamplingParams(max_tokens=2)

    async def run() -> tuple[list[list[Sample]], list[list[Sample]]]:
        async with client([slow, fast]) as rc:
            busy = asyncio.create_task(
                rc.agenerate([[1, 2], [1, 3]], 1, params, expected_version=0)
            )
            while not (
                rc.endpoint_stats()[fast]["requests"] == 1
                and rc.endpoint_stats()[fast]["outstanding"] == 0
            ):
                await asyncio.sleep(0.01)
            # round-robin would pick `slow` now; it still holds one request, `fast` holds none
            later = await rc.agenerate([[1, 4]], 1, params, expected_version=0)
            return await busy, later

    busy, later = asyncio.run(run())
    assert [g[0].endpoint for g in busy] == [slow, fast]
    assert later[0][0].endpoint == fast
    assert slow_controls.requests["/v1/completions"] == 1
    assert fast_controls.requests["/v1/completions"] == 2


def test_fails_over_when_one_endpoint_is_down(servers) -> None:
    live, controls = servers[0]
    dead = dead_endpoint()
    rc = client([dead, live])
    groups = rc.generate(
        [[1, 10 + i] for i in range(6)], 2, SamplingParams(max_tokens=4), expected_version=1
    )
    assert all(len(g) == 2 and all(s.endpoint == live for s in g) for g in groups)
    assert controls.requests["/v1/completions"] == 6
    assert rc.endpoint_stats()[dead]["failures"] >= 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_retries_transient_5xx(engine: str, servers) -> None:
    url, controls = servers[0]
    controls.fail_next = 2
    groups = client([url], engine).generate(
        [PROMPTS[0]], 2, SamplingParams(max_tokens=4), expected_version=0
    )
    assert len(groups[0]) == 2
    assert controls.requests[PATHS[engine]] == 3  # two 503s, then the answer


def test_all_endpoints_down_raises_naming_them() -> None:
    dead = [dead_endpoint(), dead_endpoint()]
    started = time.monotonic()
    with pytest.raises(RolloutError) as info:
        client(dead, max_retries=3).generate(
            [[1, 2]], 1, SamplingParams(max_tokens=2), expected_version=0
        )
    assert time.monotonic() - started < 5
    assert all(url in str(info.value) for url in dead)
    assert set(info.value.endpoints) == set(dead)
    assert "ConnectError" in info.value.last_error


def test_timeout_is_honored_and_fails_over(servers) -> None:
    (slow, slow_controls), (fast, _) = servers
    slow_controls.delay_s = 3.0
    started = time.monotonic()
    with pytest.raises(RolloutError, match=r"timed out after 0\.3s") as info:
        client([slow], timeout_s=0.3, max_retries=1).generate(
            [[1, 2]], 1, SamplingParams(max_tokens=2), expected_version=0
        )
    assert time.monotonic() - started < 2.0
    assert slow_controls.requests["/v1/completions"] == 2 and info.value.endpoints == [slow]
    groups = client([slow, fast], timeout_s=0.3).generate(
        [[1, 2], [1, 3]], 1, SamplingParams(max_tokens=2), expected_version=0
    )
    assert {g[0].endpoint for g in groups} == {fast}


def test_api_key_is_sent_as_bearer(model_dir: Path) -> None:
    app = create_app(model_dir, api_key="s3cret")
    url, stop = serve_in_thread(app)
    try:
        with pytest.raises(RolloutError, match="HTTP 401") as info:
            client([url]).generate([[1, 2]], 1, SamplingParams(max_tokens=2), expected_version=0)
        assert info.value.endpoints == [url]
        assert app.state.controls.requests["/v1/completions"] == 1  # a 401 is not retried
        groups = client([url], "sglang", api_key="s3cret").generate(
            [[1, 2]], 2, SamplingParams(max_tokens=2), expected_version=0
        )
        assert len(groups[0]) == 2
        assert app.state.controls.auth_headers == [None, "Bearer s3cret"]
    finally:
        stop()


def test_bad_request_is_reported_not_retried(servers) -> None:
    url, controls = servers[0]
    with pytest.raises(RolloutError, match=r"HTTP 400.*maximum context length"):
        client([url]).generate([[1] * 600], 1, SamplingParams(max_tokens=4), expected_version=0)
    with pytest.raises(RolloutError, match=r"HTTP 404.*does not exist"):
        client([url]).generate(
            [[1]], 1, SamplingParams(max_tokens=4), model="nope", expected_version=0
        )
    assert controls.requests["/v1/completions"] == 2


def test_health_and_wait_ready(servers) -> None:
    live = servers[0][0]
    dead = dead_endpoint()
    rc = client([live, dead])
    assert rc.health() == {live: True, dead: False}
    rc.wait_ready(2.0, require_all=False)
    with pytest.raises(RolloutError, match=f"not ready after 0.3s: {dead}$"):
        rc.wait_ready(0.3)
    client([live]).wait_ready(2.0)


def test_async_context_shares_one_connection_pool(servers) -> None:
    urls = [url for url, _ in servers]

    async def run() -> tuple[list[list[Sample]], list[list[Sample]], dict[str, bool]]:
        async with client(urls) as rc:
            first = await rc.agenerate(
                [PROMPTS[0]], 1, SamplingParams(max_tokens=2), expected_version=0
            )
            second = await rc.agenerate(
                [PROMPTS[1]], 1, SamplingParams(max_tokens=2), expected_version=0
            )
            return first, second, await rc.ahealth()

    first, second, health = asyncio.run(run())
    assert len(first[0]) == len(second[0]) == 1
    assert health == dict.fromkeys(urls, True)


def test_a_vanished_replica_costs_a_connect_timeout_not_the_request_timeout() -> None:
    """A deleted pod's address drops SYNs without a reset: connects give up in seconds and
    the request moves to another replica, while generation keeps the long read timeout."""
    from lorarl.trainer.generation.client import CONNECT_TIMEOUT_S

    c = RolloutClient(["http://127.0.0.1:1"], "vllm", model_name="m", timeout_s=300)
    timeout = c._new_http().timeout
    assert timeout.connect == CONNECT_TIMEOUT_S <= 5.0
    assert timeout.read == timeout.pool == 300


class Silent:
    """A replica that vanished after taking requests: it accepts connections and never answers
    anything (a deleted pod's address, a node gone: no reset, only silence)."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_requests_in_flight_on_a_silent_replica_move_on_long_before_the_request_timeout(
    servers,
) -> None:
    (live, live_controls), _ = servers
    silent = Silent()
    try:
        rc = client([silent.url, live], timeout_s=300, probe_interval_s=0.2,
                    probe_timeout_s=0.3, probe_misses=2)  # fmt: skip
        started = time.monotonic()
        groups = rc.generate(PROMPTS * 2, 1, SamplingParams(max_tokens=2), expected_version=0)
        took = time.monotonic() - started
    finally:
        silent.close()
    assert took < 10, took  # the probes gave up after ~1 s, not the 300 s request timeout
    assert {g[0].endpoint for g in groups} == {live}
    assert rc.requests_by_endpoint()[silent.url] >= 1  # it did get requests, then lost them
    assert live_controls.requests["/v1/completions"] == len(PROMPTS) * 2


def test_a_slow_replica_that_answers_its_probes_keeps_its_requests(servers) -> None:
    (slow, slow_controls), _ = servers
    slow_controls.delay_s = 1.5  # each generation takes longer than the probes allow silence
    rc = client([slow], timeout_s=30, probe_interval_s=0.2, probe_timeout_s=0.3, probe_misses=2)
    groups = rc.generate([PROMPTS[0]], 1, SamplingParams(max_tokens=2), expected_version=0)
    assert groups[0][0].endpoint == slow
    assert slow_controls.requests["/v1/completions"] == 1  # not abandoned, not retried
    assert slow_controls.requests["/health"] >= 3  # it was probed while it worked
