"""examples/autoscaling/ and docs/autoscaling.md cannot drift: their scale target is the CRD's
group/version/kind with a scale subresource, every metric they name is one a real trainer
/metrics response carries, and the scrape setup matches the pods the operator renders."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from lorarl.api.reports.progress import StepRecord
from lorarl.api.validation import parse_job
from lorarl.operator import builders
from lorarl.plan import plan
from lorarl.plan.addressing import CLUSTER_PORTS
from lorarl.trainer.telemetry.progress import ProgressServer, ProgressTracker
from tests.unit.operator.test_operator_builders import _admits

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "autoscaling"
CRD = yaml.safe_load((ROOT / "crds" / "lorarljobs.lorarl.dev.yaml").read_text())
JOB = yaml.safe_load((ROOT / "examples" / "quickstart-cluster.yaml").read_text())
SIGNAL = "lorarl_rollout_backlog_per_engine_last_step"


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def kind(name: str, k: str) -> dict[str, Any]:
    (found,) = [d for d in docs(name) if d["kind"] == k]
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The metric names of a real /metrics answer once a step is recorded."""
    tracker = ProgressTracker("x", total_steps=2, output_dir=tmp_path_factory.mktemp("out"))
    tracker.watch_engines(lambda: {"http://e:1": {"requests": 1, "outstanding": 0}})
    tracker.record(
        StepRecord(step=1, time=1.0, reward_mean=0.5, step_seconds=2.0, generate_seconds=1.0),
        None,
    )
    server = ProgressServer(tracker, port=0, host="127.0.0.1").start()
    try:
        text = httpx.get(f"http://127.0.0.1:{server.port}/metrics").text
    finally:
        server.stop()
        tracker.finish("Succeeded")
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_examples_parse_and_the_directory_holds_only_them() -> None:
    assert sorted(p.name for p in EXAMPLES.iterdir()) == [
        "hpa.yaml",
        "keda-scaledobject.yaml",
        "prometheus.yaml",
    ]
    for path in EXAMPLES.iterdir():
        assert docs(path.name), path


def test_scale_targets_are_the_lorarljob_and_its_scale_subresource() -> None:
    (version,) = [v for v in CRD["spec"]["versions"] if v["served"] and v["storage"]]
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.rollout.replicas"
    assert scale["statusReplicasPath"] == ".status.rolloutReplicas"
    assert scale["labelSelectorPath"] == ".status.rolloutSelector"
    target = {
        "apiVersion": f"{CRD['spec']['group']}/{version['name']}",
        "kind": CRD["spec"]["names"]["kind"],
        "name": JOB["metadata"]["name"],
    }
    keda = kind("keda-scaledobject.yaml", "ScaledObject")
    hpa = kind("hpa.yaml", "HorizontalPodAutoscaler")
    assert keda["spec"]["scaleTargetRef"] == target == hpa["spec"]["scaleTargetRef"]
    kubernetes_validate.validate(hpa, "1.30", strict=True)
    assert hpa["apiVersion"] == "autoscaling/v2"


def test_the_examples_name_only_metrics_the_trainer_serves(served: set[str]) -> None:
    named = set()
    for path in EXAMPLES.iterdir():
        named |= set(re.findall(r"\blorarl_[a-z_]+", path.read_text()))
    named |= set(re.findall(r"\blorarl_[a-z_]+", (ROOT / "docs" / "autoscaling.md").read_text()))
    assert SIGNAL in named and named <= served, sorted(named - served)
    (trigger,) = kind("keda-scaledobject.yaml", "ScaledObject")["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    job = JOB["metadata"]["name"]
    assert f'{SIGNAL}{{namespace="default", job="{job}"}}' in trigger["metadata"]["query"]
    (metric,) = kind("hpa.yaml", "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["external"]["metric"] == {
        "name": SIGNAL,
        "selector": {"matchLabels": {"job": job}},
    }
    adapter = yaml.safe_load(kind("hpa.yaml", "ConfigMap")["data"]["config.yaml"])
    (rule,) = adapter["externalRules"]
    assert rule["name"]["as"] == SIGNAL and rule["seriesQuery"].startswith(SIGNAL + "{")


def _rendered() -> dict[str, dict[str, Any]]:
    doc = copy.deepcopy(JOB)
    doc["metadata"]["namespace"] = "default"
    doc["spec"]["rollout"]["replicas"] = 2
    job = parse_job(doc)
    p = plan(job)
    return {
        f"{r.role}-{x.index}": builders.pod(p, job, r.role, x.index)
        for r in p.roles
        for x in r.replicas
    }


def test_the_scrape_setup_reaches_trainer_rank_0_and_nothing_else() -> None:
    pods = _rendered()
    port = CLUSTER_PORTS["progress"]
    monitor = kind("prometheus.yaml", "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["honorLabels"]) == (
        "progress",
        "/metrics",
        True,
    )
    wanted = monitor["spec"]["selector"]["matchLabels"]
    picked = [n for n, p in pods.items() if wanted.items() <= p["metadata"]["labels"].items()]
    assert picked == ["trainer-0"]
    trainer = pods["trainer-0"]
    (container,) = trainer["spec"]["containers"]
    assert {"name": "progress", "containerPort": port, "protocol": "TCP"} in container["ports"]
    assert trainer["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
    assert all("annotations" not in p["metadata"] for n, p in pods.items() if n != "trainer-0")

    policy = {**kind("prometheus.yaml", "NetworkPolicy")}
    kubernetes_validate.validate(policy, "1.30", strict=True)
    policy["metadata"] = {**policy["metadata"], "namespace": "default"}
    chosen = [
        n
        for n, p in pods.items()
        if policy["spec"]["podSelector"]["matchLabels"].items() <= p["metadata"]["labels"].items()
    ]
    assert chosen == ["trainer-0"]
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    assert _admits(policy, "monitoring", prometheus, port)
    assert not _admits(policy, "monitoring", prometheus, CLUSTER_PORTS["sync"])
    assert not _admits(policy, "monitoring", {"app": "other"}, port)
    assert not _admits(policy, "default", prometheus, port)


def test_the_documented_preemptible_snippet_is_a_valid_rollout_section() -> None:
    text = (ROOT / "docs" / "autoscaling.md").read_text()
    section = text[text.index("## Preemptible rollout pods") :]
    block = re.search(r"```yaml\n(.*?)```", section, flags=re.S).group(1)  # type: ignore[union-attr]
    doc = copy.deepcopy(JOB)
    doc["spec"]["rollout"] |= yaml.safe_load(block)["rollout"]
    job = parse_job(doc)
    p = plan(job)
    pod = builders.pod(p, job, "rollout", 0)
    assert pod["spec"]["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
            "effect": "NoSchedule"} in pod["spec"]["tolerations"]  # fmt: skip
