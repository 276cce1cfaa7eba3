"""`lorarl run --local` with a hub id: the model is fetched before the run folder changes, and a
continued run goes on with the commit it loaded, even after the hub's branch moved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from harness.services.hub_server import HubServer
from lorarl.api.resource import LoRARLJob
from lorarl.hub import HubError
from lorarl.local import session
from lorarl.local.runner import RunFailed

REPO = "lorarl-test/tiny"


def _job(endpoint: str) -> LoRARLJob:
    model = {"path": REPO, "hub": {"endpoint": endpoint}}
    return LoRARLJob.model_validate(
        {
            "apiVersion": "lorarl.dev/v1alpha1",
            "kind": "LoRARLJob",
            "metadata": {"name": "hub"},
            "spec": {"model": model, "data": {"trainFiles": ["t.jsonl"]}},
        }
    )


def _repo(folder: Path, version: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"version": version}))
    (folder / "model.safetensors").write_text(f"weights {version}")
    return folder


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[LoRARLJob]:
    """The jobs LocalRun was started with (a stand-in that stops at once)."""
    jobs: list[LoRARLJob] = []

    class StoppedRun:
        def __init__(self, job, run_dir, **kw):
            jobs.append(job)
            self.run_dir = Path(run_dir)

        def start(self):
            pass

        def wait(self, **kw):
            raise RunFailed("stopped by the test")

        def stop(self):
            pass

    for name in ("HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_TOKEN", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(session, "check_inputs", lambda job: None)
    monkeypatch.setattr(session, "find_engine_python", lambda path, module: "python")
    monkeypatch.setattr(session, "LocalRun", StoppedRun)
    return jobs


def _run(job: LoRARLJob, run_dir: Path, **kw) -> int:
    console = Console(record=True, width=300)
    return session.run_local(job, run_dir=str(run_dir), status_port=-1, console=console, **kw)


def test_a_continued_run_keeps_its_commit_after_the_hub_moves(
    tmp_path: Path, started: list[LoRARLJob]
) -> None:
    with HubServer({REPO: _repo(tmp_path / "v1", "1")}) as hub:
        first = hub.sha(REPO)
        job = _job(hub.url)
        run_dir = tmp_path / "runs" / "hub"
        assert _run(job, run_dir) == 1
        assert Path(started[-1].spec.model.path).name == first
        (run_dir / "checkpoints" / "step-2").mkdir(parents=True)  # the run got somewhere
        moved = hub.publish(REPO, _repo(tmp_path / "v2", "2"))
        assert _run(job, run_dir, existing="resume") == 1
        assert Path(started[-1].spec.model.path).name == first  # not `moved`
        record = json.loads((run_dir / "model.json").read_text())
        assert record["revision"] == first
        # a fresh run takes the hub's main as it is now
        assert _run(job, run_dir, existing="fresh") == 1
        assert Path(started[-1].spec.model.path).name == moved


def test_an_unreachable_hub_changes_nothing(tmp_path: Path, started: list[LoRARLJob]) -> None:
    with HubServer({}) as hub:
        endpoint = hub.url
    job = _job(endpoint)
    with pytest.raises(HubError, match=r"^spec\.model\.path: cannot download"):
        _run(job, tmp_path / "runs" / "hub")
    assert started == [] and not (tmp_path / "runs").exists()
