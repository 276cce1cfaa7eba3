"""A hub id as `spec.model.path` in a local run (issue 37 #3): the model comes from a server that
speaks the hub's protocol (harness/services/hub_server.py, driven by huggingface_hub's own client),
with the user's token, into the user's hub cache, once; a second run needs no network; a hub
that cannot be reached with the model not in the cache is one line from `lorarl run --local`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.services.hub_server import HubServer
from harness.workloads.local_jobs import hf_engine, letter_job, read_history
from lorarl.local import LocalRun
from lorarl.local.runs import run_info
from lorarl.model_checks import model_problems
from lorarl.plan import ContainerPlan, ReplicaPlan

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
REPO, TOKEN = "lorarl-test/tiny-letters", "hf_test_token"
TRAINING = {"totalSteps": 3, "promptsPerStep": 8, "microBatchSize": 16, "checkpointInterval": 3}


def planned_model_engine(replica: ReplicaPlan, container: ContainerPlan) -> list[str]:
    """The test engine on the folder the plan gives the engine (`--model`): the snapshot."""
    command = container.command
    return hf_engine(replica, container, model=command[command.index("--model") + 1])


def hub_job(root: Path, endpoint: str, name: str = "hub"):
    job = letter_job(root, name=name, training=TRAINING)  # makes the model folder it serves
    job.spec.model = job.spec.model.model_validate(
        {"path": REPO, "dtype": "float32", "hub": {"endpoint": endpoint}}
    )
    return job


def run(job, run_dir: Path) -> None:
    with LocalRun(job, run_dir, engine_command=planned_model_engine) as local:
        local.start()
        result = local.wait(timeout_s=600)
    assert result.progress is not None and result.progress.phase == "Succeeded"


@pytest.fixture
def user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The user's environment: their hub cache and token."""
    for name in ("HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return cache


def test_a_gated_hub_model_runs_from_the_users_cache_and_again_offline(
    tmp_path: Path, user: Path
) -> None:
    letter_job(tmp_path)  # the tiny model the hub serves
    with HubServer({REPO: tmp_path / "model"}, tokens={REPO: TOKEN}) as hub:
        endpoint = hub.url
        job = hub_job(tmp_path, endpoint)
        run(job, tmp_path / "run")
        commit = hub.sha(REPO)
        gets = hub.count("get", path="model.safetensors", repo=REPO)
    assert gets == 1  # downloaded once, for every process of the run
    snapshot = user / "models--lorarl-test--tiny-letters" / "snapshots" / commit
    assert (snapshot / "model.safetensors").is_file()
    record = json.loads((tmp_path / "run" / "model.json").read_text())
    assert record == {"source": REPO, "revision": commit, "path": str(snapshot)}
    # every process read the snapshot folder: the run's config says so
    config = yaml.safe_load((tmp_path / "run" / "job.yaml").read_text())
    assert config["spec"]["model"]["path"] == str(snapshot)
    assert [h["step"] for h in read_history(tmp_path / "run")] == [1, 2, 3]
    shown = run_info(tmp_path / "run").status.model  # what `lorarl status` prints
    assert shown is not None and (shown.source, shown.revision) == (REPO, commit)

    # `lorarl validate --deep` reads the cached snapshot (no network): module names are checked.
    deep = hub_job(tmp_path, endpoint, name="hub-deep")
    deep.spec.lora.target_modules = ["no_such_proj"]
    problems = model_problems(deep, cluster=False)
    assert any("no_such_proj names no module" in p for p in problems), problems

    # The hub is gone: the branch it resolved last time is in the cache, nothing is fetched.
    again = hub_job(tmp_path, endpoint, name="hub-offline")
    run(again, tmp_path / "run-offline")
    assert json.loads((tmp_path / "run-offline" / "model.json").read_text())["revision"] == commit


def test_an_unreachable_hub_with_nothing_cached_is_one_line(tmp_path: Path, user: Path) -> None:
    with HubServer({}) as hub:
        endpoint = hub.url  # a port that nothing listens on once the server stops
    job = hub_job(tmp_path, endpoint)
    job_file = tmp_path / "job.yaml"
    doc = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    job_file.write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [sys.executable, "-m", "lorarl.cli.main", "run", str(job_file), "--local",
         "--run-dir", str(tmp_path / "run"), "--status-port", "-1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.returncode != 0
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(said) == 1 and said[0].count("spec.model.path:") == 1, said
    assert REPO in said[0] and endpoint in said[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()  # nothing started
