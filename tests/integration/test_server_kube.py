"""KubeStore + KubeAuth over HTTP against a fake API server (TokenReview, SAR, lorarljobs)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from lorarl.server import KubeApi, KubeAuth, KubeStore, create_app
from lorarl.server.auth import Unauthenticated
from lorarl.server.stores import StoreUnavailable
from tests.support.fake_kube_auth import FakeKubeApi
from tests.support.fake_trainer import FakeTrainer

ALICE, BOB, ADMIN, NOBODY = "alice-token", "bob-token", "admin-token", "nobody-token"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def kube():
    fake = FakeKubeApi()
    fake.add_user(ALICE, "alice", ("get", "team-a"), ("list", "team-a"))
    fake.add_user(BOB, "bob", ("list", "team-b"))  # may list team-b, not get
    fake.add_user(ADMIN, "admin", ("get", ""), ("list", ""))
    fake.add_user(NOBODY, "nobody")
    fake.add_job("team-a", "a1", step=5)
    fake.add_job("team-a", "a2", phase="Succeeded", step=100)
    fake.add_job("team-b", "b1")
    fake.add_job("team-c", "c1")
    yield fake
    fake.stop()


@pytest.fixture
def trainer():
    with FakeTrainer(job="a1", total_steps=100) as t:
        t.step(4)
        yield t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def client(kube: FakeKubeApi, trainer: FakeTrainer, clock: Clock):
    api = KubeApi(kube.url, token=kube.server_token)
    store = KubeStore(api, progress_url=trainer.url)
    with TestClient(create_app(store, auth=KubeAuth(api, ttl=10.0, clock=clock))) as c:
        yield c
    api.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/jobs/team-a/a1", "/v1/jobs/team-a/a1/metrics"])
def test_no_token_is_401(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert "missing bearer token" in response.json()["detail"]


@pytest.mark.parametrize("headers", [bearer("stolen"), {"Authorization": "Basic YTpi"}])
def test_bad_token_is_401(client: TestClient, headers: dict) -> None:
    response = client.get("/v1/jobs/team-a/a1", headers=headers)
    assert response.status_code == 401


def test_rejected_token_says_why(client: TestClient) -> None:
    response = client.get("/v1/jobs", headers=bearer("stolen"))
    assert response.status_code == 401
    assert response.json()["detail"] == "invalid bearer token: token not recognized"


def test_get_needs_the_get_right(client: TestClient) -> None:
    assert client.get("/v1/jobs/team-a/a1", headers=bearer(ALICE)).status_code == 200
    for path in ("/v1/jobs/team-b/b1", "/v1/jobs/team-b/b1/metrics"):
        response = client.get(path, headers=bearer(BOB))
        assert response.status_code == 403
        assert response.json()["detail"] == (
            "user 'bob' may not get lorarljobs.lorarl.dev in namespace 'team-b'"
        )
    # 403 before 404: a caller without rights learns nothing about what exists
    assert client.get("/v1/jobs/team-b/ghost", headers=bearer(ALICE)).status_code == 403


def test_sar_asks_the_right_question(client: TestClient, kube: FakeKubeApi) -> None:
    client.get("/v1/jobs/team-a/a1", headers=bearer(ALICE))
    [spec] = kube.sar_log
    assert spec["user"] == "alice" and spec["groups"] == ["team"] and spec["uid"] == "uid-alice"
    assert spec["resourceAttributes"] == {
        "verb": "get",
        "group": "lorarl.dev",
        "resource": "lorarljobs",
        "namespace": "team-a",
    }


def test_list_only_shows_namespaces_the_caller_may_list(client: TestClient) -> None:
    def names(token: str) -> list[str]:
        response = client.get("/v1/jobs", headers=bearer(token))
        assert response.status_code == 200
        return [f"{r['namespace']}/{r['name']}" for r in response.json()["items"]]

    assert names(ALICE) == ["team-a/a1", "team-a/a2"]
    assert names(BOB) == ["team-b/b1"]
    assert names(ADMIN) == ["team-a/a1", "team-a/a2", "team-b/b1", "team-c/c1"]
    assert names(NOBODY) == []


def test_list_one_namespace(client: TestClient) -> None:
    ok = client.get("/v1/jobs", params={"namespace": "team-a"}, headers=bearer(ALICE))
    assert [r["name"] for r in ok.json()["items"]] == ["a1", "a2"]
    row = ok.json()["items"][0]
    assert (
        row["phase"],
        row["step"],
        row["totalSteps"],
        row["rewardMean"],
        row["lastSyncSeconds"],
    ) == ("Running", 5, 100, 0.25, 0.4)
    assert row["ageSeconds"] > 0
    denied = client.get("/v1/jobs", params={"namespace": "team-b"}, headers=bearer(ALICE))
    assert denied.status_code == 403


def test_job_detail_from_the_object(client: TestClient) -> None:
    detail = client.get("/v1/jobs/team-a/a1", headers=bearer(ALICE)).json()
    assert detail["source"] == "kubernetes" and detail["detail"] is None
    assert detail["spec"] == {
        "model": "/models/tiny",
        "algorithm": "grpo",
        "groupSize": 8,
        "loraRank": 16,
        "loraAlpha": 32.0,
        "trainerReplicas": 1,
        "rolloutReplicas": 2,
        "engine": "vllm",
        "syncMode": "adapter",
        "totalSteps": 100,
    }
    assert detail["status"]["step"] == 5
    assert [(c["type"], c["reason"]) for c in detail["conditions"]] == [("Running", "TrainerReady")]


def test_missing_job_is_404_for_an_authorized_caller(client: TestClient) -> None:
    for path in ("/v1/jobs/team-a/ghost", "/v1/jobs/team-a/ghost/metrics"):
        response = client.get(path, headers=bearer(ALICE))
        assert response.status_code == 404
        assert response.json() == {"detail": "LoRARLJob team-a/ghost not found"}


def test_metrics_are_proxied_from_the_trainer(client: TestClient, trainer: FakeTrainer) -> None:
    response = client.get("/v1/jobs/team-a/a1/metrics", headers=bearer(ALICE))
    body = response.json()
    assert response.status_code == 200 and body["live"] is True
    assert [s["step"] for s in body["steps"]] == [1, 2, 3, 4]
    assert [s["kl"] for s in body["steps"]] == pytest.approx([0.001, 0.004, 0.009, 0.016])
    assert trainer.requests[-1] == "/progress/history"


def test_unreachable_trainer_gives_empty_history_with_detail(
    client: TestClient, trainer: FakeTrainer
) -> None:
    trainer.stop()
    response = client.get("/v1/jobs/team-a/a1/metrics", headers=bearer(ALICE))
    body = response.json()
    assert response.status_code == 200
    assert body["steps"] == [] and body["live"] is False
    assert "trainer's progress endpoint did not answer" in body["detail"]
    assert trainer.url in body["detail"]


def test_samples_come_from_the_trainer_or_say_where_they_are(
    client: TestClient, trainer: FakeTrainer
) -> None:
    # This fake trainer has no /progress/samples: the reply points at the files on the volume.
    body = client.get("/v1/jobs/team-a/a1/samples", headers=bearer(ALICE)).json()
    assert body["samples"] == [] and body["live"] is False
    assert "samples.jsonl in training.outputDir" in body["detail"]
    assert trainer.requests[-1] == "/progress/samples"
    assert client.get("/v1/jobs/team-a/ghost/samples", headers=bearer(ALICE)).status_code == 404
    assert client.get("/v1/jobs/team-b/b1/samples", headers=bearer(ALICE)).status_code == 403


def test_default_progress_url_is_the_rank0_pod(kube: FakeKubeApi) -> None:
    store = KubeStore(KubeApi(kube.url, token=kube.server_token))
    assert store.progress_url("team-a", "a1") == "http://a1-trainer-0.a1.team-a.svc:8080"


def test_reviews_are_cached_per_token_for_ttl(
    client: TestClient, kube: FakeKubeApi, clock: Clock
) -> None:
    for _ in range(3):
        assert client.get("/v1/jobs/team-a/a1", headers=bearer(ALICE)).status_code == 200
    assert (kube.calls["tokenreview"], kube.calls["sar"]) == (1, 1)
    client.get("/v1/jobs/team-a/a1", headers=bearer(ADMIN))
    assert (kube.calls["tokenreview"], kube.calls["sar"]) == (2, 2)
    clock.now += 10.5
    client.get("/v1/jobs/team-a/a1", headers=bearer(ALICE))
    assert (kube.calls["tokenreview"], kube.calls["sar"]) == (3, 3)


def test_revoked_right_stops_working_after_ttl(
    client: TestClient, kube: FakeKubeApi, clock: Clock
) -> None:
    assert client.get("/v1/jobs/team-a/a1", headers=bearer(ALICE)).status_code == 200
    kube.grants.discard(("alice", "get", "team-a"))
    assert client.get("/v1/jobs/team-a/a1", headers=bearer(ALICE)).status_code == 200  # cached
    clock.now += 11
    assert client.get("/v1/jobs/team-a/a1", headers=bearer(ALICE)).status_code == 403


def test_server_credentials_rejected_is_503_not_open(kube: FakeKubeApi) -> None:
    api = KubeApi(kube.url, token="wrong-server-token")
    app = create_app(KubeStore(api), auth=KubeAuth(api))
    with TestClient(app) as client:
        response = client.get("/v1/jobs", headers=bearer(ALICE))
    assert response.status_code == 503
    assert "could not review the request" in response.json()["detail"]


def test_store_error_is_503(kube: FakeKubeApi) -> None:
    api = KubeApi(kube.url, token="wrong-server-token")
    with TestClient(create_app(KubeStore(api))) as client:
        response = client.get("/v1/jobs/team-a/a1")
    assert response.status_code == 503
    assert "reading LoRARLJobs from the Kubernetes API" in response.json()["detail"]


def test_object_that_does_not_parse_still_lists(client: TestClient, kube: FakeKubeApi) -> None:
    kube.jobs[("team-a", "a2")]["spec"]["lora"]["rank"] = 0  # violates rank > 0
    rows = client.get("/v1/jobs", headers=bearer(ALICE)).json()["items"]
    assert [r["name"] for r in rows] == ["a1", "a2"] and rows[1]["phase"] == "Succeeded"
    detail = client.get("/v1/jobs/team-a/a2", headers=bearer(ALICE)).json()
    assert detail["spec"] is None
    assert "LoRARLJob team-a/a2 does not match" in detail["detail"]


def test_openapi_declares_bearer_auth(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    responses = spec["paths"]["/v1/jobs/{namespace}/{name}"]["get"]["responses"]
    assert {"401", "403", "404"} <= set(responses)


def test_kube_auth_directly(kube: FakeKubeApi) -> None:
    auth = KubeAuth(KubeApi(kube.url, token=kube.server_token))
    with pytest.raises(Unauthenticated, match="invalid bearer token"):
        auth.authenticate("stolen")
    user = auth.authenticate(ADMIN)
    assert user.username == "admin" and user.token_hash and ADMIN not in repr(user)
    assert auth.allowed(user, "list", "") and auth.allowed(user, "get", "anything")


def test_in_cluster_reads_service_account_token_each_call(
    kube: FakeKubeApi, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, port = kube.url.removeprefix("http://").split(":")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    (tmp_path / "token").write_text("rotated-away\n")
    api = KubeApi.in_cluster(tmp_path)
    assert api.base_url == f"https://{host}:{port}"
    # the fake speaks plain HTTP; swap the scheme but keep the service-account token handling
    api = KubeApi(kube.url, token_file=tmp_path / "token")
    store = KubeStore(api)
    with pytest.raises(StoreUnavailable, match="401"):
        store.list_jobs()
    (tmp_path / "token").write_text(kube.server_token + "\n")  # the kubelet rotated it
    assert len(store.list_jobs()) == 4


def test_single_namespace_install_reads_only_its_namespace(kube: FakeKubeApi) -> None:
    api = KubeApi(kube.url, token=kube.server_token)
    store = KubeStore(api, namespace="team-a", progress_url="http://127.0.0.1:9")
    with TestClient(create_app(store, auth=KubeAuth(api))) as client:
        rows = client.get("/v1/jobs", headers=bearer(ADMIN)).json()["items"]
        assert [(r["namespace"], r["name"]) for r in rows] == [("team-a", "a1"), ("team-a", "a2")]
        other = client.get("/v1/jobs", params={"namespace": "team-b"}, headers=bearer(ADMIN))
        assert other.json() == {"items": []}
        response = client.get("/v1/jobs/team-b/b1", headers=bearer(ADMIN))
        assert response.status_code == 404
        assert response.json() == {"detail": "LoRARLJob team-b/b1 not found"}
    assert kube.calls["get"] == 0  # never asked the API server outside its namespace
