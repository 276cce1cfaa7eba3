"""What the API server would refuse in the job's children is refused when the job is validated:
quantities, names, mount paths, sizes (so the operator never retries a write that cannot work)."""

from __future__ import annotations

import copy
import re
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from lorarl.api.resource import MAX_CONFIG_BYTES, config_bytes
from lorarl.api.spec.job import RESERVED_MOUNT_PATHS
from lorarl.api.spec.k8s import DNS1123_LABEL, DNS1123_SUBDOMAIN, LABEL_VALUE, quantity_value
from lorarl.api.validation import check_manifest, parse_job
from lorarl.operator import builders
from lorarl.plan import plan
from lorarl.plan.build import CONFIG_DIR, SHM_DIR

ROOT = Path(__file__).resolve().parents[3]
BASE = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())


def doc_with(**spec: object) -> dict:
    doc = copy.deepcopy(BASE)
    for key, value in spec.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
    return doc


@pytest.mark.parametrize(
    ("text", "value"),
    [("500m", "0.5"), ("2", "2"), (3, "3"), ("1Gi", str(2**30)), ("1e3", "1000"),
     ("1.5k", "1500"), ("+4M", "4000000"), ("2E-1", "0.2"), ("1E", "1e18")],
)  # fmt: skip
def test_quantities_are_read_as_the_api_server_reads_them(text, value) -> None:
    assert quantity_value(text) == Decimal(value)


def test_requests_over_limits_are_refused_where_the_api_server_would() -> None:
    ok = doc_with(
        trainer={"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1024Mi"}}}
    )
    assert check_manifest(ok) == []
    over = doc_with(trainer={"resources": {"requests": {"cpu": "1500m"}, "limits": {"cpu": 1}}})
    assert [p.path for p in check_manifest(over)] == ["spec.trainer.resources.requests"]
    # extended resources (a reward model on a GPU) cannot be overcommitted
    reward = {"function": "exact_match", "service": {}}
    fpga = {"requests": {"example.com/fpga": 1}, "limits": {"example.com/fpga": 2}}
    bad = doc_with(reward={**reward, "service": {"resources": fpga}})
    assert [p.path for p in check_manifest(bad)] == ["spec.reward.service.resources.requests"]


def test_the_rendered_config_must_fit_a_config_map() -> None:
    doc = doc_with(reward={"params": {"metadata_key": "x" * MAX_CONFIG_BYTES}})
    problems = [str(p) for p in check_manifest(doc)]
    assert problems == [
        f"the job rendered as its ConfigMap's job.yaml exceeds {MAX_CONFIG_BYTES} bytes (1 MiB, "
        "the ConfigMap limit): keep large data such as reward params in files on a volume"
    ]
    assert check_manifest(doc, cluster=False) == []  # a local run writes a file, not a ConfigMap
    job = parse_job(doc_with())
    data = builders.config_map(plan(job))["data"]
    assert config_bytes(job) == len(data["job.yaml"].encode())  # the rule measures what is sent


def test_claims_cannot_share_a_mount_path_with_each_other_or_with_lorarl() -> None:
    assert set(RESERVED_MOUNT_PATHS) == {CONFIG_DIR, SHM_DIR, builders.TMP_DIR}
    for path in [*RESERVED_MOUNT_PATHS, "/outputs"]:
        doc = doc_with(data={"volume": {"claimName": "d", "mountPath": path}})
        assert [p.path for p in check_manifest(doc)] == ["spec"], path
    doc = doc_with(data={"volume": {"claimName": "d", "mountPath": "/data"}})
    j = parse_job(doc, cluster=True)
    p = plan(j)
    for role in p.roles:
        for replica in role.replicas:
            for c in builders.pod(p, j, role.role, replica.index)["spec"]["containers"]:
                paths = [m["mountPath"] for m in c["volumeMounts"]]
                assert len(paths) == len(set(paths)), (role.role, paths)


def test_the_longest_name_and_most_replicas_still_make_valid_child_names() -> None:
    doc = doc_with(
        trainer={"replicas": 1024},
        rollout={"replicas": 1024},
        reward={"function": "exact_match", "params": {}, "service": {}},
        scheduling={"queueName": "q" * 63},
    )
    doc["metadata"]["name"] = "j" * 40
    j = parse_job(doc, cluster=True)
    p = plan(j)
    label = re.compile(DNS1123_LABEL)
    for role in p.roles:
        for i in (0, len(role.replicas) - 1):
            pod = builders.pod(p, j, role.role, i)
            name = pod["metadata"]["name"]
            assert len(name) <= 63 and label.fullmatch(name), name  # also the pod's hostname
            for value in pod["metadata"]["labels"].values():
                assert len(value) <= 63 and re.fullmatch(LABEL_VALUE, value), value
    for obj in (builders.service(p), builders.network_policy(p, "ops")):
        assert len(obj["metadata"]["name"]) <= 63 and label.fullmatch(obj["metadata"]["name"])
    for name in (builders.config_map_name(j.name), builders.secret_name(j.name)):
        assert len(name) <= 253 and re.fullmatch(DNS1123_SUBDOMAIN, name)
    doc["metadata"]["name"] = "j" * 41
    assert [p.path for p in check_manifest(doc)] == ["metadata.name"]
    doc["metadata"]["name"] = "ok"
    doc["spec"]["scheduling"] = {"queueName": "q" * 64}
    assert [p.path for p in check_manifest(doc)] == ["spec.scheduling.queueName"]
