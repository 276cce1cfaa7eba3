"""A hub id in a cluster plan: each trainer and rollout pod fetches it first (the init container,
with the token), the other containers read the cache read-only, and every process's config and
engine command name the cache folder, never the hub id."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from lorarl.api.validation import parse_job
from lorarl.operator import builders
from lorarl.plan import plan
from lorarl.plan.hub import DEFAULT_CACHE_DIR, FETCH_CONTAINER

ROOT = Path(__file__).resolve().parents[3]
BASE = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_job(uid: str = "6f1c", **model: object):
    doc = copy.deepcopy(BASE)
    doc["metadata"]["uid"] = uid
    doc["spec"]["model"] = {"path": "Qwen/Qwen3-0.6B", "dtype": "float32", **model}
    return parse_job(doc, cluster=True)


def pods(job, **kw):
    p = plan(job)
    return [
        builders.pod(p, job, role.role, r.index, **kw) for role in p.roles for r in role.replicas
    ]


def test_every_model_reading_pod_fetches_the_hub_id_first_with_the_token_only_there():
    job = hub_job(
        revision="v2",
        hub={"endpoint": "https://hf-mirror.com", "tokenSecret": {"name": "hf", "key": "token"}},
    )
    made = pods(job)
    assert [p["metadata"]["name"] for p in made] == [
        "quickstart-trainer-0", "quickstart-rollout-0", "quickstart-rollout-1",
    ]  # fmt: skip
    folder = f"{DEFAULT_CACHE_DIR}/lorarl/quickstart-6f1c"
    for pod in made:
        (init,) = pod["spec"]["initContainers"]
        assert init["name"] == FETCH_CONTAINER
        assert init["image"] == pod["spec"]["containers"][0]["image"]  # the pod's own image
        assert init["command"] == [
            "python", "-m", "lorarl.hub", "--repo", "Qwen/Qwen3-0.6B", "--revision", "v2",
            "--cache", DEFAULT_CACHE_DIR, "--pin", "quickstart-6f1c",
            "--endpoint", "https://hf-mirror.com",
        ]  # fmt: skip
        token = [e for e in init["env"] if e["name"] == "HF_TOKEN"]
        assert token == [
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
        ]
        assert {"name": "model", "mountPath": DEFAULT_CACHE_DIR} in init["volumeMounts"]
        assert init["securityContext"]["runAsNonRoot"] is True
        assert {"name": "model", "emptyDir": {}} in pod["spec"]["volumes"]  # one cache per pod
        for c in pod["spec"]["containers"]:
            assert all(e["name"] != "HF_TOKEN" for e in c["env"]), c["name"]
            mount = next(m for m in c["volumeMounts"] if m["name"] == "model")
            assert mount == {"name": "model", "mountPath": DEFAULT_CACHE_DIR, "readOnly": True}
    engine = next(c for c in made[1]["spec"]["containers"] if c["name"] == "engine")
    assert engine["command"][engine["command"].index("--model") + 1] == folder
    # what every process reads: a folder, nothing about the hub
    model = plan(job).config["spec"]["model"]
    assert model == {"path": folder, "dtype": "float32", "trustRemoteCode": False}


def test_a_shared_claim_is_the_cache_writable_for_the_fetch_only():
    job = hub_job(volume={"claimName": "hub-cache", "mountPath": "/hub"})
    for pod in pods(job):
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "hub-cache"}} in pod[
            "spec"
        ]["volumes"]
        init = pod["spec"]["initContainers"][0]
        assert init["command"][init["command"].index("--cache") + 1] == "/hub"
        assert {"name": "model", "mountPath": "/hub"} in init["volumeMounts"]
        for c in pod["spec"]["containers"]:
            assert {"name": "model", "mountPath": "/hub", "readOnly": True} in c["volumeMounts"]
    assert plan(job).config["spec"]["model"]["path"] == "/hub/lorarl/quickstart-6f1c"


def test_a_pinned_commit_replaces_the_branch_and_a_new_job_gets_its_own_pin():
    job = hub_job()
    init = pods(job, model_revision=COMMIT)[0]["spec"]["initContainers"][0]
    assert init["command"][init["command"].index("--revision") + 1] == COMMIT
    first = pods(job)[0]["spec"]["initContainers"][0]["command"]
    assert first[first.index("--revision") + 1] == "main"
    # the same name recreated (another uid) never reuses the old job's pin in a shared cache
    again = pods(hub_job(uid="9a0b"))[0]["spec"]["initContainers"][0]["command"]
    assert again[again.index("--pin") + 1] == "quickstart-9a0b"


def test_a_folder_model_has_no_init_container():
    doc = copy.deepcopy(BASE)
    job = parse_job(doc, cluster=True)
    assert all("initContainers" not in p["spec"] for p in pods(job))
