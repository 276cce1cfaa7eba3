"""The FastAPI app over a LocalStore: routes, 404s, /metrics, OpenAPI, the dashboard files."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from harness.engines.fake_trainer import FakeTrainer
from lorarl.server import LocalStore, create_app
from lorarl.server.serve import check_bind
from tests.unit.server.test_server_local import make_job, write_run


@pytest.fixture
def trainer():
    with FakeTrainer(job="live") as t:
        t.step(2)
        yield t


@pytest.fixture
def client(trainer: FakeTrainer, tmp_path):
    store = LocalStore()
    store.add(make_job("live"), trainer.url)
    write_run(tmp_path, steps=3)
    store.add_finished(make_job("done"), tmp_path)
    with TestClient(create_app(store)) as c:
        yield c


def samples(text: str, name: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_list_jobs(client: TestClient) -> None:
    response = client.get("/v1/jobs")
    assert response.status_code == 200
    rows = {r["name"]: r for r in response.json()["items"]}
    assert set(rows) == {"done", "live"}
    assert (rows["live"]["phase"], rows["live"]["step"], rows["live"]["totalSteps"]) == (
        "Running",
        2,
        10,
    )
    assert rows["done"]["phase"] == "Succeeded"
    assert rows["done"]["rewardMean"] == pytest.approx(0.3)
    assert rows["done"]["lastSyncSeconds"] == pytest.approx(0.23)
    assert client.get("/v1/jobs", params={"namespace": "other"}).json() == {"items": []}


def test_get_job_and_metrics(client: TestClient) -> None:
    detail = client.get("/v1/jobs/local/live").json()
    assert detail["spec"]["loraRank"] == 8 and detail["spec"]["syncMode"] == "merged"
    assert detail["status"]["phase"] == "Running" and detail["live"] is True
    assert detail["conditions"] == detail["status"]["conditions"]
    metrics = client.get("/v1/jobs/local/done/metrics").json()
    assert [s["step"] for s in metrics["steps"]] == [1, 2, 3]
    assert [s["rewardMean"] for s in metrics["steps"]] == pytest.approx([0.1, 0.2, 0.3])


@pytest.mark.parametrize(
    "path", ["/v1/jobs/local/ghost", "/v1/jobs/local/ghost/metrics", "/v1/jobs/prod/ghost"]
)
def test_missing_job_is_404_naming_it(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    ns = path.split("/")[3]
    assert response.json() == {"detail": f"LoRARLJob {ns}/ghost not found"}


def test_prometheus_metrics(client: TestClient) -> None:
    client.get("/v1/jobs/local/ghost")
    client.get("/v1/jobs/local/live")
    client.get("/healthz")
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    requests = samples(response.text, "lorarl_server_requests_total")
    route = "/v1/jobs/{namespace}/{name}"
    assert requests[(("method", "GET"), ("route", route), ("status", "404"))] == 1
    assert requests[(("method", "GET"), ("route", route), ("status", "200"))] == 1
    assert requests[(("method", "GET"), ("route", "/healthz"), ("status", "200"))] == 1
    jobs = samples(response.text, "lorarl_server_jobs")
    assert jobs == {(("phase", "Running"),): 1, (("phase", "Succeeded"),): 1}
    assert samples(response.text, "lorarl_server_store_up") == {(): 1}


def test_health_docs_and_openapi(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert "swagger" in client.get("/docs").text.lower()
    spec = client.get("/openapi.json").json()
    assert {
        "/v1/jobs",
        "/v1/jobs/{namespace}/{name}",
        "/v1/jobs/{namespace}/{name}/metrics",
        "/healthz",
        "/metrics",
    } <= set(spec["paths"])
    metrics_200 = spec["paths"]["/v1/jobs/{namespace}/{name}/metrics"]["get"]["responses"]
    assert "404" in metrics_200
    assert "securitySchemes" not in spec.get("components", {})  # local: no auth


def test_dashboard_is_served_without_external_resources(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/dashboard/app.js">' in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'self';")
    script = client.get("/dashboard/app.js")
    assert script.status_code == 200 and "drawCharts" in script.text
    assert "Content-Security-Policy" in script.headers
    assert client.get("/dashboard/style.css").status_code == 200
    charts = client.get("/dashboard/charts.js")
    vendored = client.get("/dashboard/vendor/uPlot.iife.min.js")  # shipped, not from a CDN
    assert vendored.status_code == 200 and "uPlot" in vendored.text
    for text in (page.text, script.text, charts.text):
        assert "http://" not in text
        assert "https://" not in text
    assert "Content-Security-Policy" not in client.get("/v1/jobs").headers


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_loopback_binds_without_auth(host: str) -> None:
    check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "example.com"])
def test_non_loopback_without_auth_is_refused(host: str) -> None:
    with pytest.raises(ValueError, match=f"host '{host}': a status API without auth"):
        check_bind(host, None)
