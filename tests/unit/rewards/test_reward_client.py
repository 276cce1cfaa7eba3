"""RewardServiceClient against real HTTP servers on 127.0.0.1 that fail on purpose."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lorarl.api.spec.job import RewardServiceSpec
from lorarl.local.ports import free_port
from lorarl.rewards import RewardResult
from lorarl.rewards.service.client import RewardServiceClient, RewardServiceError, ScoreSample

Reply = tuple[int, dict | str, float]  # status, body, delay before answering


class FakeService:
    """Answers POST /score from `script(n, body) -> Reply`; records every request body."""

    def __init__(self, script: Callable[[int, dict], Reply]):
        self.script = script
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    service.bodies.append(body)
                    n = len(service.bodies)
                status, reply, delay = service.script(n, body)
                time.sleep(delay)
                data = (reply if isinstance(reply, str) else json.dumps(reply)).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting

            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/healthz" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def calls(self) -> int:
        return len(self.bodies)


@pytest.fixture()
def serve() -> Iterator[Callable[[Callable[[int, dict], Reply]], FakeService]]:
    started: list[FakeService] = []

    def start(script: Callable[[int, dict], Reply]) -> FakeService:
        svc = FakeService(script)
        svc.thread.start()
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.server.shutdown()
        svc.server.server_close()


def exact_scores(body: dict) -> dict:
    """What a healthy service answers: 1.0 where completion == groundTruth."""
    samples = body["samples"]
    return {
        "scores": [float(s["completion"] == s["groundTruth"]) for s in samples],
        "infos": [{"n": len(s["completion"])} for s in samples],
    }


SAMPLES = [
    ScoreSample("1+1=", "2", "2"),
    {"prompt": "2+2=", "completion": "5", "ground_truth": "4", "metadata": {"id": 7}},
]


def client(url: str, sleeps: list[float] | None = None, **kwargs) -> RewardServiceClient:
    opts = {"timeout_s": 2.0, "max_retries": 3, "backoff_s": 0.1, **kwargs}
    return RewardServiceClient(
        url, sleep=sleeps.append if sleeps is not None else time.sleep, **opts
    )


def test_scores_come_back_in_order_with_infos(serve):
    svc = serve(lambda n, body: (200, exact_scores(body), 0.0))
    with client(svc.url) as c:
        results = c.score(SAMPLES)
    assert results == [RewardResult(1.0, {"n": 1}), RewardResult(0.0, {"n": 1})]
    sent = svc.bodies[0]["samples"]
    assert sent[1] == {
        "prompt": "2+2=",
        "completion": "5",
        "groundTruth": "4",
        "metadata": {"id": 7},
    }
    assert "reward" not in svc.bodies[0]


def test_retries_5xx_then_succeeds_with_exponential_backoff(serve):
    def flaky(n: int, body: dict) -> Reply:
        if n <= 2:
            return (503 if n == 1 else 500), {"detail": "replica restarting"}, 0.0
        return 200, exact_scores(body), 0.0

    svc = serve(flaky)
    sleeps: list[float] = []
    results = client(svc.url, sleeps).score(SAMPLES)
    assert [r.score for r in results] == [1.0, 0.0]
    assert svc.calls == 3
    assert sleeps == [0.1, 0.2]  # backoff_s * 2**(attempt-1)


def test_always_failing_service_raises_after_all_retries(serve):
    svc = serve(lambda n, body: (502, {"detail": "bad gateway"}, 0.0))
    sleeps: list[float] = []
    with pytest.raises(RewardServiceError) as err:
        client(svc.url, sleeps, max_retries=2).score(SAMPLES)
    assert svc.calls == 3
    assert sleeps == [0.1, 0.2]
    msg = str(err.value)
    assert svc.url in msg and "after 3 attempt(s)" in msg and "HTTP 502: bad gateway" in msg


def test_timeouts_are_retried(serve):
    svc = serve(lambda n, body: (200, exact_scores(body), 1.0 if n == 1 else 0.0))
    results = client(svc.url, [], timeout_s=0.3).score(SAMPLES)
    assert [r.score for r in results] == [1.0, 0.0]
    assert svc.calls == 2


def test_connection_refused_is_retried_then_reported():
    port = free_port()  # nobody listens on it
    sleeps: list[float] = []
    with pytest.raises(RewardServiceError, match=r"after 4 attempt\(s\).*ConnectError"):
        client(f"http://127.0.0.1:{port}", sleeps).score(SAMPLES)
    assert len(sleeps) == 3


def test_client_errors_are_not_retried(serve):
    svc = serve(lambda n, body: (422, {"detail": "exact_match needs a ground truth"}, 0.0))
    with pytest.raises(RewardServiceError, match=r"HTTP 422: exact_match needs a ground truth"):
        client(svc.url, []).score(SAMPLES)
    assert svc.calls == 1


@pytest.mark.parametrize(
    "reply, match",
    [
        ({"scores": [1.0], "infos": [{}]}, "returned 1 scores and 1 infos for 2 samples"),
        ({"scores": [1.0, "NaN"], "infos": [{}, {}]}, "returned score 'NaN' for sample 1"),
        ({"oops": True}, "unreadable answer"),
    ],
)
def test_malformed_answers_raise(serve, reply, match):
    svc = serve(lambda n, body: (200, reply, 0.0))
    with pytest.raises(RewardServiceError, match=match):
        client(svc.url, []).score(SAMPLES)


def test_large_batches_are_chunked_and_reward_is_named(serve):
    svc = serve(lambda n, body: (200, exact_scores(body), 0.0))
    samples = [ScoreSample("", str(i), str(i % 2)) for i in range(5)]
    results = client(svc.url, reward="exact_match", max_samples_per_request=2).score(samples)
    assert [r.score for r in results] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert [len(b["samples"]) for b in svc.bodies] == [2, 2, 1]
    assert {b["reward"] for b in svc.bodies} == {"exact_match"}


def test_from_spec_and_health(serve):
    svc = serve(lambda n, body: (200, exact_scores(body), 0.0))
    spec = RewardServiceSpec(timeoutSeconds=7, maxRetries=5)
    c = RewardServiceClient.from_spec(svc.url + "/", spec)
    assert (c.url, c.timeout_s, c.max_retries) == (svc.url, 7, 5)
    assert c.healthy()
    assert not client("http://127.0.0.1:9", timeout_s=0.5).healthy()


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="must start with http"):
        RewardServiceClient("localhost:8000")
    with pytest.raises(ValueError, match="max_retries >= 0"):
        RewardServiceClient("http://x", max_retries=-1)


def test_the_trainer_waits_for_a_reward_service_that_went_away(serve):
    """A reward pod restarting: the client's retries run out, the trainer's scorer waits for
    /healthz like at start-up and scores the same batch, instead of failing the step. A refusal
    (4xx) is not waited for."""
    from lorarl.trainer.generation.rewards import score_remote

    down = {"until": 3}  # answers 503 to the first 3 requests, then comes back
    svc = serve(
        lambda n, body: (
            (503, "restarting", 0.0) if n <= down["until"] else (200, exact_scores(body), 0.0)
        )
    )
    c = client(svc.url, [], max_retries=1)
    args = (["1+1=", "2+2="], ["2", "5"], ["2", "4"], [None, None])
    results = score_remote(c, *args, outage_timeout_s=10)
    assert [r.score for r in results] == [1.0, 0.0]
    assert svc.calls == 4  # 2 failed attempts, the wait for /healthz, a 503, then the answer

    refused = serve(lambda n, body: (422, {"detail": "no ground truth"}, 0.0))
    with pytest.raises(RewardServiceError, match="HTTP 422"):
        score_remote(client(refused.url, [], max_retries=1), *args, outage_timeout_s=10)
    assert refused.calls == 1
