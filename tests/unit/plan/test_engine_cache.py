"""rollout.cacheVolume: the engines' compile caches on a claim, mounted writable on the engine
container only (its own pod, or the colocated trainer pod), with vLLM's, Inductor's and
Triton's cache variables pointing into it; refused read-only or on a taken mount path; a local
run names it as cluster-only and keeps the user's cache."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from lorarl.api import LoRARLJob
from lorarl.api.spec.placement import COLOCATED_PROCESSES_ENV
from lorarl.api.validation import ManifestError, parse_job
from lorarl.local.cluster_fields import local_warning
from lorarl.local.runner import local_job
from lorarl.operator.builders import pod
from lorarl.plan import plan
from lorarl.plan.build import ENGINE_CACHE_VOLUME

CACHE = {"claimName": "engine-cache", "mountPath": "/var/cache/engines"}
BASE = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "job", "namespace": "ml", "uid": "u1"},
    "spec": {
        "model": {"path": "/models/m", "volume": {"claimName": "models", "mountPath": "/models"}},
        "data": {"trainFiles": ["t.jsonl"]},
        "rollout": {"engine": "vllm", "gpusPerReplica": 0, "replicas": 2, "cacheVolume": CACHE},
    },
}
CACHE_ENV = {
    "VLLM_CACHE_ROOT": "/var/cache/engines/vllm",
    "TORCHINDUCTOR_CACHE_DIR": "/var/cache/engines/torchinductor",
    "TRITON_CACHE_DIR": "/var/cache/engines/triton",
}


def make(trainer: dict | None = None, **rollout) -> LoRARLJob:
    """The job as the webhook admits it (the cluster rules included)."""
    d = copy.deepcopy(BASE)
    d["spec"]["rollout"].update(rollout)
    d["spec"]["trainer"] = trainer or {}
    d["spec"]["training"] = {"outputDir": "/out", "volume": {"claimName": "o", "mountPath": "/out"}}
    return parse_job(d, cluster=True)


def pods(job: LoRARLJob) -> dict[str, dict]:
    p = plan(job)
    return {r.name: pod(p, job, role.role, r.index) for role in p.roles for r in role.replicas}


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_every_engine_mounts_the_claim_and_keeps_its_caches_there():
    made = pods(make())
    claim = {"name": ENGINE_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": "engine-cache"}}
    assert claim not in made["job-trainer-0"]["spec"]["volumes"]
    for name in ("job-rollout-0", "job-rollout-1"):
        spec = made[name]["spec"]
        assert claim in spec["volumes"]
        engine, sidecar = (next(c for c in spec["containers"] if c["name"] == n)
                           for n in ("engine", "sidecar"))  # fmt: skip
        mount = {"name": ENGINE_CACHE_VOLUME, "mountPath": "/var/cache/engines"}
        assert mount in engine["volumeMounts"]  # writable: no readOnly
        assert all(m["name"] != ENGINE_CACHE_VOLUME for m in sidecar["volumeMounts"])
        assert CACHE_ENV.items() <= env_of(engine).items()
        assert not CACHE_ENV.keys() & env_of(sidecar).keys()


def test_without_the_claim_caches_stay_in_the_pods_tmp():
    made = pods(make(cacheVolume=None))
    for p in made.values():
        assert all(v["name"] != ENGINE_CACHE_VOLUME for v in p["spec"]["volumes"])
        for c in p["spec"]["containers"]:
            env = env_of(c)
            assert not CACHE_ENV.keys() & env.keys()
            assert env["XDG_CACHE_HOME"] == "/tmp/.cache"


def test_a_colocated_engine_gets_the_claim_in_the_trainer_pod():
    job = make(placement="colocated", replicas=1, trainer={"gpusPerReplica": 0})
    (trainer_pod,) = pods(job).values()
    spec = trainer_pod["spec"]
    assert {
        "name": ENGINE_CACHE_VOLUME,
        "persistentVolumeClaim": {"claimName": "engine-cache"},
    } in (spec["volumes"])
    (one,) = spec["containers"]
    assert {"name": ENGINE_CACHE_VOLUME, "mountPath": "/var/cache/engines"} in one["volumeMounts"]
    processes = {p["name"]: p for p in json.loads(env_of(one)[COLOCATED_PROCESSES_ENV])}
    assert CACHE_ENV.items() <= processes["engine"]["env"].items()
    assert not CACHE_ENV.keys() & processes["trainer"]["env"].keys()


@pytest.mark.parametrize(
    ("cache", "words"),
    [
        ({**CACHE, "readOnly": True}, "compile caches"),
        ({**CACHE, "mountPath": "/models"}, "distinct mountPaths"),
        ({**CACHE, "mountPath": "/tmp"}, "distinct mountPaths"),
    ],
)
def test_a_claim_the_engines_cannot_write_or_mount_is_refused(cache, words):
    with pytest.raises(ManifestError, match=words):
        make(cacheVolume=cache)


def test_a_local_run_names_it_and_keeps_the_users_cache(tmp_path: Path):
    job = make()
    warning = local_warning(job)
    assert warning is not None and "spec.rollout.cacheVolume" in warning
    local = local_job(job, tmp_path)
    assert local.spec.rollout.cache_volume is None
    assert job.spec.rollout.cache_volume is not None  # the user's job is not changed
