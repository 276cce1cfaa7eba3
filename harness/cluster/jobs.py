"""Cluster-shaped jobs on `harness.cluster.cluster`: the quickstart reshaped for a cluster, the
claims it reads and writes, and following one job from `kubectl apply` to Succeeded (shared by
tests/e2e/test_cluster_e2e.py and bench/cluster_e2e.py)."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.cluster.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
CLAIMS = {
    "models": "/models",
    "data": "/data",
    "outputs": "/outputs",
    "hub-cache": "/hub",
    "engine-cache": "/engine-cache",
}
JOB_LABEL = "lorarl.dev/job"
Obj = dict[str, Any]


@functools.cache
def prepare_assets() -> None:
    """The quickstart's model and data (`lorarl prepare quickstart`): once per test process
    (each call is an interpreter start and the imports, ~5 s here)."""
    subprocess.run([sys.executable, "-m", "lorarl.cli.main", "prepare", "quickstart"], cwd=ROOT,
                   check=True, capture_output=True, timeout=300)  # fmt: skip


def engine_cache_store() -> Path:
    """What backs the `engine-cache` claim (the jobs' `rollout.cacheVolume`): unlike the other
    claims it outlives each test cluster, as an admin's PersistentVolume outlives the jobs, so
    only the machine's first engine pod inspects the model class and compiles kernels."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lorarl" / "test-cluster-engine-cache"


def provision(c: Cluster) -> None:
    """What an admin does first: the claims, with the quickstart's model and data on them."""
    store = engine_cache_store()
    store.mkdir(parents=True, exist_ok=True)
    store.chmod(0o1777)  # every pod's user writes there (the claim is a link, not chowned)
    claim_dir = c.kubelet.claim_dir("default", "engine-cache")
    if not claim_dir.is_symlink():
        claim_dir.rmdir()
        claim_dir.symlink_to(store)
    for claim in CLAIMS:
        spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}
        meta = {"name": claim, "namespace": "default"}
        c.apply(yaml.safe_dump(
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}
        ))  # fmt: skip
    model = ROOT / QUICKSTART["spec"]["model"]["path"]
    shutil.copytree(model, c.kubelet.claim_dir("default", "models") / model.name)
    for data in QUICKSTART["spec"]["data"]["trainFiles"]:
        shutil.copy(ROOT / data, c.kubelet.claim_dir("default", "data"))
    # Readable by the pods' user (uid 10001): `save_pretrained` leaves the weights 0600, which
    # a pod reads as "No such file or directory" (safetensors' message for EACCES).
    for claim in ("models", "data"):
        subprocess.run(["chmod", "-R", "a+rX", str(c.kubelet.claim_dir("default", claim))],
                       check=True)  # fmt: skip


def write_val_file(c: Cluster) -> str:
    """Validation prompts on the data claim: the quickstart task's distinct prompts (it has no
    others, so they are training prompts too); returns the path a pod reads."""
    (train,) = QUICKSTART["spec"]["data"]["trainFiles"]
    rows = {json.loads(line)["prompt"]: line for line in (ROOT / train).read_text().splitlines()}
    path = c.kubelet.claim_dir("default", "data") / "val.jsonl"
    path.write_text("".join(line + "\n" for _, line in sorted(rows.items())))
    path.chmod(0o644)  # read by the pods' user
    return f"/data/{path.name}"


def cluster_job(name: str, **spec: Any) -> Obj:
    """The quickstart with its inputs and outputs on claims, as a cluster user writes it."""
    job = copy.deepcopy(QUICKSTART)
    job["metadata"] = {"name": name, "namespace": "default"}
    s = job["spec"]
    s["model"]["path"] = f"/models/{Path(s['model']['path']).name}"
    s["model"]["volume"] = {"claimName": "models", "mountPath": "/models", "readOnly": True}
    s["data"]["trainFiles"] = [f"/data/{Path(f).name}" for f in s["data"]["trainFiles"]]
    s["data"]["volume"] = {"claimName": "data", "mountPath": "/data", "readOnly": True}
    s["training"]["outputDir"] = f"/outputs/{name}"
    s["training"]["volume"] = {"claimName": "outputs", "mountPath": "/outputs"}
    s["rollout"]["cacheVolume"] = {"claimName": "engine-cache", "mountPath": "/engine-cache"}
    # A 2-core node: one thread per rank, as a user sizes torch to the pod's CPUs.
    s["trainer"]["env"] = [{"name": "OMP_NUM_THREADS", "value": "1"}]
    for key, value in spec.items():
        section, _, leaf = key.partition("__")
        if leaf:
            s[section][leaf] = value
        else:
            s[section] = value
    return job


@dataclass
class Run:
    name: str
    seconds: float  # kubectl apply -> Succeeded
    job: Obj
    pods_running_s: dict[str, float]  # pod -> seconds from apply to Running
    served: list[Obj] = field(default_factory=list)  # the status API's step history, last seen
    forbidden: int | None = None  # what the status API answered a token without the Role
    timeline: dict[str, dict[str, float]] = field(default_factory=dict)  # pod -> event -> s
    applied_at: float = 0.0  # wall clock of the apply (step records carry wall times)


def run_job(c: Cluster, job: Obj, timeout: float) -> Run:
    """`kubectl apply` the job and follow it to Succeeded, reading the status API on the way
    (the step history lives in the trainer, so it is read while the trainer runs)."""
    name = job["metadata"]["name"]
    applied_at = time.time()
    start = time.monotonic()
    c.apply(yaml.safe_dump(job))
    served: list[Obj] = []
    forbidden = None
    next_read = start
    while True:
        c.kubelet.raise_errors()
        obj = c.job(name) or {}
        phase = (obj.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            break
        if time.monotonic() > start + timeout:
            raise AssertionError(f"{name}: not finished in {timeout:.0f} s: {obj.get('status')}"
                                 f"\n{trainer_log(c, name)}")  # fmt: skip
        if time.monotonic() >= next_read:
            next_read = time.monotonic() + 5
            reply = c.metrics(name, c.reader_token)
            assert reply.status_code == 200, reply.text
            served = reply.json()["steps"] or served
            forbidden = c.metrics(name, c.outsider_token).status_code
        time.sleep(0.5)
    seconds = time.monotonic() - start
    assert phase == "Succeeded", f"{name}: {obj.get('status')}\n{trainer_log(c, name)}"
    pods = {
        run.pod["metadata"]["name"]: run.running_at - start
        for run in list(c.kubelet.pods.values())  # the kubelet thread adds pods
        if (run.pod["metadata"].get("labels") or {}).get(JOB_LABEL) == name and run.running_at
    }
    timeline: dict[str, dict[str, float]] = {}
    for when, key, what in list(c.kubelet.events):
        pod = key.split("/", 1)[1]
        if when >= start and pod.startswith(f"{name}-"):
            timeline.setdefault(pod, {}).setdefault(what, round(when - start, 1))
    return Run(name, seconds, obj, pods, served, forbidden, timeline, applied_at)


def trainer_log(c: Cluster, name: str) -> str:
    try:
        return c.kubelet.logs("default", f"{name}-trainer-0", "trainer")[-4000:]
    except (AssertionError, OSError, ValueError):
        return "(no trainer log)"


def printed_columns(c: Cluster, name: str) -> dict[str, str]:
    """`kubectl get lrj NAME` as a person sees it: header -> value."""
    header, row = c.kubectl("get", "lrj", name).strip().splitlines()
    return dict(zip(header.split(), row.split(), strict=True))


def printed_column(c: Cluster, name: str, column: str, *flags: str) -> str:
    """One column of `kubectl get lrj NAME [flags]`, cut at the header's offsets (a column may
    print empty, so the row is not split on blanks)."""
    header, row = c.kubectl("get", "lrj", name, *flags).rstrip("\n").splitlines()
    found = re.search(rf"(?:^|(?<=\s)){column.upper()}(?:\s+|$)", header)
    assert found, f"no {column} column in: {header}"
    end = found.end() if found.end() < len(header) else len(row)
    return row[found.start() : end].strip()


def history(c: Cluster, name: str) -> list[Obj]:
    """The step history the trainer wrote to the output claim."""
    path = c.kubelet.claim_dir("default", "outputs") / name / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def job_pods(c: Cluster, name: str) -> list[Obj]:
    pods = c.kube.list_objects("v1/pods", "default")
    return [p for p in pods if p["metadata"]["labels"].get(JOB_LABEL) == name]


def check_adapter(c: Cluster, name: str) -> Path:
    adapter = c.kubelet.claim_dir("default", "outputs") / name / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file(), sorted(adapter.parent.rglob("*"))
    assert (adapter / "adapter_config.json").is_file()
    return adapter
