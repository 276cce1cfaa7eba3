"""The status API's KubeStore + KubeAuth on a real API server: callers are service accounts with
bound tokens (TokenRequest), their rights are RBAC Roles, the server asks TokenReview and
SubjectAccessReview as itself (a service account bound to `system:auth-delegator`), and what it
asked is read back from the API server's audit log. A control plane of its own: the listings
count every LoRARLJob in the cluster."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from harness.cluster.controlplane import wait_until
from harness.cluster.status_auth import (
    LRJ,
    PEOPLE,
    SERVER,
    World,
    account,
    apply_objects,
    job_manifest,
    jobs_rule,
    rbac,
)
from harness.cluster.status_auth import world as status_world
from harness.engines.fake_trainer import FakeTrainer
from lorarl.server import KubeApi, KubeAuth, KubeStore, create_app
from lorarl.server.auth import Unauthenticated
from lorarl.server.stores import StoreUnavailable


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with status_world(tmp_path_factory.mktemp("auth-cp")) as w:
        yield w


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def trainer() -> Iterator[FakeTrainer]:
    with FakeTrainer(job="a1", total_steps=100) as t:
        t.step(4)
        yield t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def client(world: World, trainer: FakeTrainer, clock: Clock) -> Iterator[TestClient]:
    api = world.api()
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
    assert client.get("/v1/jobs/team-a/a1", headers=headers).status_code == 401


def test_rejected_token_says_why(client: TestClient) -> None:
    response = client.get("/v1/jobs", headers=bearer("stolen"))
    assert response.status_code == 401
    assert response.json()["detail"].startswith("invalid bearer token: ")


def test_get_needs_the_get_right(client: TestClient, world: World) -> None:
    t = world.tokens
    assert client.get("/v1/jobs/team-a/a1", headers=bearer(t["alice"])).status_code == 200
    for path in ("/v1/jobs/team-b/b1", "/v1/jobs/team-b/b1/metrics"):
        response = client.get(path, headers=bearer(t["bob"]))
        assert response.status_code == 403
        assert response.json()["detail"] == (
            f"user '{account('bob')}' may not get lorarljobs.lorarl.dev in namespace 'team-b'"
        )
    # 403 before 404: a caller without rights learns nothing about what exists
    assert client.get("/v1/jobs/team-b/ghost", headers=bearer(t["alice"])).status_code == 403


def test_sar_asks_the_right_question(client: TestClient, world: World) -> None:
    before = len(world.reviews("subjectaccessreviews"))
    client.get("/v1/jobs/team-a/a1", headers=bearer(world.tokens["alice"]))
    wait_until(lambda: len(world.reviews("subjectaccessreviews")) > before, 10, "the SAR audited")
    spec = world.reviews("subjectaccessreviews")[-1]["requestObject"]["spec"]
    assert spec["user"] == account("alice")
    assert f"system:serviceaccounts:{PEOPLE}" in spec["groups"] and spec["uid"]
    assert spec["resourceAttributes"] == {
        "verb": "get",
        "group": "lorarl.dev",
        "resource": "lorarljobs",
        "namespace": "team-a",
    }


def test_list_only_shows_namespaces_the_caller_may_list(client: TestClient, world: World) -> None:
    def names(who: str) -> list[str]:
        response = client.get("/v1/jobs", headers=bearer(world.tokens[who]))
        assert response.status_code == 200
        return [f"{r['namespace']}/{r['name']}" for r in response.json()["items"]]

    assert names("alice") == ["team-a/a1", "team-a/a2"]
    assert names("bob") == ["team-b/b1"]
    assert names("admin") == ["team-a/a1", "team-a/a2", "team-b/b1", "team-c/c1"]
    assert names("nobody") == []


def test_list_one_namespace(client: TestClient, world: World) -> None:
    alice = bearer(world.tokens["alice"])
    ok = client.get("/v1/jobs", params={"namespace": "team-a"}, headers=alice)
    assert [r["name"] for r in ok.json()["items"]] == ["a1", "a2"]
    row = ok.json()["items"][0]
    assert (row["phase"], row["step"], row["totalSteps"], row["rewardMean"],
            row["lastSyncSeconds"]) == ("Running", 5, 100, 0.25, 0.4)  # fmt: skip
    assert row["ageSeconds"] >= 0
    assert client.get("/v1/jobs", params={"namespace": "team-b"}, headers=alice).status_code == 403


def test_job_detail_from_the_object(client: TestClient, world: World) -> None:
    detail = client.get("/v1/jobs/team-a/a1", headers=bearer(world.tokens["alice"])).json()
    assert detail["source"] == "kubernetes" and detail["detail"] is None
    assert detail["spec"]["model"] == "/models/tiny"
    assert (detail["spec"]["loraRank"], detail["spec"]["syncMode"]) == (16, "adapter")
    assert detail["status"]["step"] == 5
    assert [(c["type"], c["reason"]) for c in detail["conditions"]] == [("Running", "TrainerReady")]


def test_missing_job_is_404_for_an_authorized_caller(client: TestClient, world: World) -> None:
    for path in ("/v1/jobs/team-a/ghost", "/v1/jobs/team-a/ghost/metrics"):
        response = client.get(path, headers=bearer(world.tokens["alice"]))
        assert response.status_code == 404
        assert response.json() == {"detail": "LoRARLJob team-a/ghost not found"}


def test_metrics_are_proxied_from_the_trainer(
    client: TestClient, world: World, trainer: FakeTrainer
) -> None:
    body = client.get("/v1/jobs/team-a/a1/metrics", headers=bearer(world.tokens["alice"])).json()
    assert body["live"] is True and [s["step"] for s in body["steps"]] == [1, 2, 3, 4]
    assert trainer.requests[-1] == "/progress/history"


def test_reviews_are_cached_per_token_for_ttl(
    client: TestClient, world: World, clock: Clock
) -> None:
    def counts() -> tuple[int, int]:
        return len(world.reviews("tokenreviews")), len(world.reviews("subjectaccessreviews"))

    def settled(expected: tuple[int, int]) -> None:
        wait_until(lambda: counts() == expected, 10, f"reviews {expected} audited")

    t0 = counts()
    for _ in range(3):
        client.get("/v1/jobs/team-a/a1", headers=bearer(world.tokens["alice"]))
    settled((t0[0] + 1, t0[1] + 1))
    client.get("/v1/jobs/team-a/a1", headers=bearer(world.tokens["admin"]))
    settled((t0[0] + 2, t0[1] + 2))
    clock.now += 10.5
    client.get("/v1/jobs/team-a/a1", headers=bearer(world.tokens["alice"]))
    settled((t0[0] + 3, t0[1] + 3))
    time.sleep(1.0)  # and no more than that
    assert counts() == (t0[0] + 3, t0[1] + 3)


def test_revoked_right_stops_working_after_ttl(
    client: TestClient, world: World, clock: Clock
) -> None:
    alice = bearer(world.tokens["alice"])
    assert client.get("/v1/jobs/team-a/a1", headers=alice).status_code == 200
    world.cp.kubectl_ok("delete", "rolebinding", "lrj-alice", "-n", "team-a")
    try:
        assert client.get("/v1/jobs/team-a/a1", headers=alice).status_code == 200  # cached
        clock.now += 11
        assert client.get("/v1/jobs/team-a/a1", headers=alice).status_code == 403
    finally:
        apply_objects(world.cp, *rbac("Role", "alice", jobs_rule("get", "list"), "team-a"))


def test_server_credentials_rejected_is_503_not_open(world: World) -> None:
    api = world.api("wrong-server-token")
    with TestClient(create_app(KubeStore(api), auth=KubeAuth(api))) as client:
        response = client.get("/v1/jobs", headers=bearer(world.tokens["alice"]))
    assert response.status_code == 503
    assert "could not review the request" in response.json()["detail"]


def test_store_error_is_503(world: World) -> None:
    with TestClient(create_app(KubeStore(world.api("wrong-server-token")))) as client:
        response = client.get("/v1/jobs/team-a/a1")
    assert response.status_code == 503
    assert "reading LoRARLJobs from the Kubernetes API" in response.json()["detail"]


def test_object_that_does_not_parse_still_lists(client: TestClient, world: World) -> None:
    """A job the CRD accepts but these models refuse (a reward this server does not know: the
    webhook, not installed here, would have refused it) still lists, with a detail."""
    obj, _ = job_manifest("team-c", "odd")
    obj["spec"]["reward"] = {"function": "no_such_reward"}
    world.kube.create(LRJ, obj)
    try:
        admin = bearer(world.tokens["admin"])
        rows = client.get("/v1/jobs", params={"namespace": "team-c"}, headers=admin).json()["items"]
        assert [r["name"] for r in rows] == ["c1", "odd"]
        detail = client.get("/v1/jobs/team-c/odd", headers=admin).json()
        assert detail["spec"] is None
        assert "LoRARLJob team-c/odd does not match" in detail["detail"]
    finally:
        world.kube.delete(LRJ, "team-c", "odd")


def test_kube_auth_directly(world: World) -> None:
    auth = KubeAuth(world.api())
    with pytest.raises(Unauthenticated, match="invalid bearer token"):
        auth.authenticate("stolen")
    user = auth.authenticate(world.tokens["admin"])
    assert user.username == account("admin") and user.token_hash
    assert world.tokens["admin"] not in repr(user)
    assert auth.allowed(user, "list", "") and auth.allowed(user, "get", "anything")
    nobody = auth.authenticate(world.tokens["nobody"])
    assert not auth.allowed(nobody, "list", "") and not auth.allowed(nobody, "get", "team-a")


def test_in_cluster_reads_service_account_token_each_call(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in a pod: KUBERNETES_SERVICE_HOST/PORT, the CA and a token file the kubelet rotates."""
    host, port = world.cp.url.removeprefix("https://").split(":")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    (tmp_path / "ca.crt").write_bytes(world.cp.ca_file.read_bytes())
    (tmp_path / "token").write_text("rotated-away\n")
    store = KubeStore(KubeApi.in_cluster(tmp_path))
    with pytest.raises(StoreUnavailable, match="401"):
        store.list_jobs()
    (tmp_path / "token").write_text(world.tokens["server"] + "\n")  # the kubelet rotated it
    assert len(store.list_jobs()) == 4


def test_single_namespace_install_reads_only_its_namespace(world: World) -> None:
    api = world.api()
    store = KubeStore(api, namespace="team-a", progress_url="http://127.0.0.1:9")
    before = len(world.cp.audit(SERVER))
    with TestClient(create_app(store, auth=KubeAuth(api))) as client:
        admin = bearer(world.tokens["admin"])
        rows = client.get("/v1/jobs", headers=admin).json()["items"]
        assert [(r["namespace"], r["name"]) for r in rows] == [("team-a", "a1"), ("team-a", "a2")]
        other = client.get("/v1/jobs", params={"namespace": "team-b"}, headers=admin)
        assert other.json() == {"items": []}
        response = client.get("/v1/jobs/team-b/b1", headers=admin)
        assert response.status_code == 404
        assert response.json() == {"detail": "LoRARLJob team-b/b1 not found"}
    time.sleep(1.0)  # the audit log's last entries
    reads = [
        e for e in world.cp.audit(SERVER)[before:] if e["objectRef"]["resource"] == "lorarljobs"
    ]
    assert reads and {e["objectRef"].get("namespace") for e in reads} == {"team-a"}
