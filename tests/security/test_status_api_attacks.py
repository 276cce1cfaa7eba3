"""Attacks on the status API, its upstream reads and the JSON servers; each worked on the old code.

- A job name `.` (or `..`, or any non-DNS name) in the URL: httpx's dot-segment removal turned the
  checked `get` of `.../lorarljobs/.` into a namespace-wide `list`. Now refused with a 422 naming
  the parameter before any store or Kubernetes call.
- Whatever answers at a trainer's address sending 150 MiB (parsed whole before) or trickling one
  byte a second (held a request thread, since httpx's timeouts are per read). Now capped in bytes
  and in total time, in the status API and in the operator's poll.
- A slowloris client against the trainer's/sidecar's JsonHttpServer: held a thread forever. Now
  cut off after the per-connection deadline; headers are bounded, connections are capped.
- `/metrics` with jobs by phase was open to anyone; with auth it now needs a token RBAC lets `get`
  the non-resource URL /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import select
import socket
import socketserver
import threading
import time
import tracemalloc
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from harness.cluster.status_auth import World, account
from harness.cluster.status_auth import world as status_world
from harness.engines.fake_trainer import make_record
from lorarl.jsonhttp import REQUEST_TIMEOUT_S, JsonHttpServer
from lorarl.operator.config import OperatorConfig
from lorarl.operator.reconciler import Reconciler
from lorarl.server import KubeAuth, KubeStore, LocalStore, create_app
from lorarl.server.serve import serve_in_thread
from lorarl.server.stores import JobNotFound
from tests.unit.server.test_server_local import make_job

HUGE_MIB = 150
TRICKLE_BYTES = 20  # at 1 byte/s: the old code was held 20 s by one answer
DEADLINE_S = 3.0  # the progress client's and operator's total deadline
SLACK_S = 1.5  # scheduling slack on a loaded 2-core box


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A real API server with callers and jobs (harness/cluster/status_auth.py): what the server
    asked is read back from its audit log."""
    with status_world(tmp_path_factory.mktemp("attacks-cp")) as world:
        yield world


@pytest.fixture(scope="module")
def tokens(kube: World) -> dict[str, str]:
    return kube.tokens


# --- names in the URL -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_api(kube: World) -> Iterator[str]:
    """A real uvicorn server: an HTTP client that keeps `.` as sent (curl --path-as-is) reaches
    the route with it; TestClient's httpx would normalise it away before sending."""
    api = kube.api()
    store = KubeStore(api, progress_url="http://127.0.0.1:9")
    url, stop = serve_in_thread(create_app(store, auth=KubeAuth(api)))
    yield url
    stop()
    api.close()


def raw_get(base: str, path: str, token: str) -> tuple[int, dict]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path, headers=bearer(token))  # sent byte for byte, no normalisation
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/jobs/team-a/.", "name"),
        ("/v1/jobs/team-a/..", "name"),
        ("/v1/jobs/team-a/./metrics", "name"),
        ("/v1/jobs/team-a/%2E", "name"),
        ("/v1/jobs/team-a/%2e%2E/metrics", "name"),
        ("/v1/jobs/team-a/A1", "name"),
        ("/v1/jobs/team-a/a_1", "name"),
        ("/v1/jobs/team-a/-a1", "name"),
        ("/v1/jobs/team-a/" + "a" * 254, "name"),
        ("/v1/jobs/../a1", "namespace"),
        ("/v1/jobs/team-a.x/a1", "namespace"),
        ("/v1/jobs/Team-A/a1", "namespace"),
        ("/v1/jobs/" + "n" * 64 + "/a1", "namespace"),
        ("/v1/jobs?namespace=..", "namespace"),
        ("/v1/jobs?namespace=team-a%2F..", "namespace"),
    ],
)
def test_bad_names_are_refused_before_any_kubernetes_call(
    live_api: str, kube: World, path: str, field: str
) -> None:
    mark = len(kube.server_requests(settle=0))
    status, body = raw_get(live_api, path, kube.tokens["alice"])
    assert status == 422, body
    assert body["detail"].startswith(f"{field} '"), body
    assert "DNS-1123" in body["detail"]
    made = kube.server_requests(mark)
    assert made == [], [e["requestURI"] for e in made]  # no TokenReview, SAR, get or list


def test_good_names_still_work(live_api: str, kube: World) -> None:
    mark = len(kube.server_requests(settle=0))
    status, body = raw_get(live_api, "/v1/jobs/team-a/a1", kube.tokens["alice"])
    assert status == 200 and body["name"] == "a1"
    assert kube.jobs_reads(mark) == {"get": 1, "list": 0}
    status, body = raw_get(live_api, "/v1/jobs?namespace=team-a", kube.tokens["alice"])
    assert status == 200 and [r["name"] for r in body["items"]] == ["a1", "a2"]


def test_store_and_client_refuse_dot_segments_themselves(kube: World) -> None:
    """Defence in depth: the store and the API client are safe without the app's checks."""
    api = kube.api()
    store = KubeStore(api)
    mark = len(kube.server_requests(settle=0))
    for name in (".", "..", "a/b"):
        with pytest.raises(JobNotFound):
            store.get_job("team-a", name)
    assert store.list_jobs([".."]) == []
    with pytest.raises(ValueError, match=r"'\.' or '\.\.' segment"):
        api.get("/apis/lorarl.dev/v1alpha1/namespaces/team-a/lorarljobs/.")
    with pytest.raises(ValueError, match=r"'\.' or '\.\.' segment"):
        api.get("/apis/lorarl.dev/v1alpha1/namespaces/%2E%2E/lorarljobs")
    assert kube.server_requests(mark) == []
    api.close()


# --- upstream caps: what answers at a trainer's address -----------------------------------------


class HostileTrainer:
    """A real HTTP server where a trainer should be. Modes: `huge` (150 MiB, declared or
    close-delimited), `trickle-head` (the status line at 1 byte/s), `trickle-body` (headers at
    once, then the body at 1 byte/s)."""

    def __init__(self, mode: str, *, declare_length: bool = True) -> None:
        self.mode, self.declare_length = mode, declare_length
        self.record = json.dumps(make_record(1).wire()).encode()
        if mode == "huge":  # built before the test measures memory; only sent, never copied
            self.records = (self.record + b",") * (1024 * 1024 // (len(self.record) + 1))
            self.letters = b"x" * len(self.records)
        server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), self._handler())
        server.daemon_threads = True
        self._server = server
        threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"

    def _handler(self) -> type[socketserver.StreamRequestHandler]:
        hostile = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                path = self.rfile.readline(65537).split(b" ")[1]
                while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass
                with contextlib.suppress(OSError):  # the client hung up: that is the point
                    hostile.answer(self.wfile, path)

        return Handler

    def _parts(self, path: bytes) -> tuple[bytes, bytes, bytes]:
        if path.endswith(b"/history"):
            return b"[", self.records, self.record + b"]"
        head = b'{"job":"a1","phase":"Running","totalSteps":10,"message":"'
        return head, self.letters, b'"}'

    def answer(self, out, path: bytes) -> None:  # out: the socket's file
        head = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n"
        if self.mode == "trickle-head":
            return self._trickle(out, head)
        if self.mode == "trickle-body":
            out.write(head + b"\r\n")
            return self._trickle(out, b"[" + self.record * 10)
        prefix, filler, suffix = self._parts(path)
        length = len(prefix) + HUGE_MIB * len(filler) + len(suffix)
        if self.declare_length:
            head += f"Content-Length: {length}\r\n".encode()
        out.write(head + b"\r\n" + prefix)
        for _ in range(HUGE_MIB):
            out.write(filler)
        out.write(suffix)

    @staticmethod
    def _trickle(out, data: bytes) -> None:
        for byte in data[:TRICKLE_BYTES]:
            out.write(bytes([byte]))
            time.sleep(1.0)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _apps(kube: World, trainer_url: str) -> dict[str, tuple[TestClient, str, dict]]:
    api = kube.api()
    kube_app = create_app(KubeStore(api, progress_url=trainer_url), auth=KubeAuth(api))
    local = LocalStore()
    local.add(make_job("live"), trainer_url)
    return {  # history through the Kubernetes store, progress through the local one
        "history": (
            TestClient(kube_app),
            "/v1/jobs/team-a/a1/metrics",
            bearer(kube.tokens["alice"]),
        ),
        "progress": (TestClient(create_app(local)), "/v1/jobs/local/live", {}),
    }


@pytest.mark.parametrize("declare_length", [True, False])
@pytest.mark.parametrize("endpoint", ["history", "progress"])
def test_huge_trainer_answer_is_cut_off(kube: World, endpoint: str, declare_length: bool) -> None:
    hostile = HostileTrainer("huge", declare_length=declare_length)
    client, path, headers = _apps(kube, hostile.url)[endpoint]
    try:
        tracemalloc.start()
        start = time.monotonic()
        response = client.get(path, headers=headers)
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        hostile.stop()
    body = response.json()
    assert response.status_code == 200 and body["live"] is False, body
    assert "bytes" in body["detail"] and "over" in body["detail"], body["detail"]
    assert elapsed < DEADLINE_S + SLACK_S
    assert peak < 48 * 1024 * 1024, f"peak {peak / 2**20:.0f} MiB while refusing {HUGE_MIB} MiB"


@pytest.mark.parametrize("mode", ["trickle-head", "trickle-body"])
def test_trickling_trainer_is_cut_off_at_the_total_deadline(kube: World, mode: str) -> None:
    hostile = HostileTrainer(mode)
    client, path, headers = _apps(kube, hostile.url)["history"]
    try:
        start = time.monotonic()
        response = client.get(path, headers=headers)
        elapsed = time.monotonic() - start
    finally:
        hostile.stop()
    body = response.json()
    assert response.status_code == 200 and body["live"] is False
    assert f"no complete answer within {DEADLINE_S:g} s" in body["detail"], body["detail"]
    assert elapsed < DEADLINE_S + SLACK_S


def test_operator_poll_is_capped_too() -> None:
    job = make_job("a1")

    async def poll(url: str) -> tuple[object, float]:
        reconciler = Reconciler(kube=None, config=OperatorConfig(progress_url=url))  # type: ignore[arg-type]
        start = time.monotonic()
        try:
            return await reconciler._poll(job), time.monotonic() - start
        finally:
            await reconciler.close()

    for hostile in (HostileTrainer("huge", declare_length=False), HostileTrainer("trickle-head")):
        try:
            progress, elapsed = asyncio.run(poll(hostile.url))
        finally:
            hostile.stop()
        assert progress is None, hostile.mode  # the old code parsed the 150 MiB message
        assert elapsed < DEADLINE_S + SLACK_S, hostile.mode


# --- the JSON servers (trainer /progress, sidecar /status) --------------------------------------


@pytest.fixture
def json_server() -> Iterator[JsonHttpServer]:
    server = JsonHttpServer({"/progress": lambda: (200, {"ok": True})}, 0, "127.0.0.1").start()
    yield server
    server.stop()


def _get(port: int, path: str = "/progress") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_slowloris_client_is_disconnected(json_server: JsonHttpServer) -> None:
    sock = socket.create_connection(("127.0.0.1", json_server.port))
    request = b"GET /progress HTTP/1.1\r\nHost: trainer\r\n" + b"X-Slow: 1\r\n" * 10
    start, cut_at = time.monotonic(), None
    try:
        for byte in request:  # one byte a second, well inside any per-read timeout
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                cut_at = time.monotonic()
                break
            if select.select([sock], [], [], 1.0)[0]:
                try:
                    data = sock.recv(1024)
                except ConnectionResetError:
                    data = b""
                assert data == b"", data  # never an answer to an unfinished request
                cut_at = time.monotonic()
                break
            if time.monotonic() - start > REQUEST_TIMEOUT_S + 5:
                break
        assert _get(json_server.port) == 200  # meanwhile the server answers others
    finally:
        sock.close()
    assert cut_at is not None, "the slow client was never disconnected"
    assert cut_at - start < REQUEST_TIMEOUT_S + SLACK_S


def test_oversized_headers_and_other_methods_are_refused(json_server: JsonHttpServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", json_server.port, timeout=5)
    conn.putrequest("GET", "/progress")
    for i in range(40):  # 40 KiB of headers: the stdlib alone accepts up to 100 x 64 KiB
        conn.putheader(f"X-Pad-{i}", "a" * 1000)
    conn.endheaders()
    assert conn.getresponse().status == 431
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", json_server.port, timeout=5)
    conn.request("POST", "/progress", body=b"{}")
    assert conn.getresponse().status == 501
    conn.close()


def test_connections_beyond_the_cap_are_closed() -> None:
    server = JsonHttpServer({"/p": lambda: (200, {})}, 0, "127.0.0.1", max_connections=2).start()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
    try:
        time.sleep(0.3)  # both are being served (waiting for their request)
        extra = socket.create_connection(("127.0.0.1", server.port))
        extra.settimeout(2)
        extra.sendall(b"GET /p HTTP/1.0\r\n\r\n")
        assert extra.recv(1024) == b""  # closed unanswered
        extra.close()
    finally:
        for s in idle:
            s.close()
    time.sleep(0.3)  # their slots are free again
    assert _get(server.port, "/p") == 200
    server.stop()


# --- /metrics ------------------------------------------------------------------------------------


def test_metrics_need_a_token_allowed_to_get_metrics(kube: World) -> None:
    api = kube.api()
    store = KubeStore(api, progress_url="http://127.0.0.1:9")
    with TestClient(create_app(store, auth=KubeAuth(api))) as client:
        anonymous = client.get("/metrics")
        assert anonymous.status_code == 401 and "lorarl_server_jobs" not in anonymous.text
        assert anonymous.headers["www-authenticate"] == "Bearer"
        # alice may read jobs, not /metrics
        denied = client.get("/metrics", headers=bearer(kube.tokens["alice"]))
        assert denied.status_code == 403
        assert denied.json() == {"detail": f"user '{account('alice')}' may not get /metrics"}
        mark = len(kube.server_requests(settle=0))
        scrape = client.get("/metrics", headers=bearer(kube.tokens["prometheus"]))
        assert scrape.status_code == 200
        assert 'lorarl_server_jobs{phase="Running"} 3.0' in scrape.text  # a1, b1, c1
        [review] = [
            e for e in kube.server_requests(mark)
            if e["objectRef"]["resource"] == "subjectaccessreviews"
        ]  # fmt: skip
        spec = review["requestObject"]["spec"]
        assert spec["nonResourceAttributes"] == {"verb": "get", "path": "/metrics"}
    api.close()
