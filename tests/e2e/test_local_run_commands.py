"""The day-to-day commands on a real `lorarl run --local` of the quickstart: `status` while it
runs, `stop` in the middle (nothing left running, the checkpoint kept), `resume` from that
checkpoint to the end, then `list`, `status` and `logs` of the finished run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness.cluster.jobs import prepare_assets
from lorarl.api.reports import run_files
from tests.e2e.test_local_run import processes_of

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def lorarl(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lorarl.cli.main", *args], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def test_stop_and_resume_a_local_run(tmp_path: Path, engine_python: str):
    prepare_assets()
    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["spec"]["training"].update(totalSteps=6, checkpointInterval=2)
    # One engine and one trainer rank: the commands are under test here, not the fleet (the
    # quickstart's two of each are run by test_local_run and test_readme).
    doc["spec"]["rollout"]["replicas"] = 1
    doc["spec"]["trainer"]["processesPerReplica"] = 1
    job_file = tmp_path / "quickstart.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    runs_dir = tmp_path / "runs"
    run_dir = runs_dir / "quickstart"
    env = {**os.environ, "LORARL_ENGINE_PYTHON": engine_python, "COLUMNS": "120"}
    where = ("--local", "--runs-dir", str(runs_dir))
    with (tmp_path / "run.log").open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lorarl.cli.main", "run", str(job_file), "--local",
             "--run-dir", str(run_dir), "--status-port", "0"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / "step-000002").is_dir():
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.5)
        status = lorarl("status", "quickstart", *where, env=env)
        assert status.returncode == 0, status.stderr
        assert status.stdout.startswith("quickstart · Running · step ")
        assert f"running (pid {proc.pid})" in status.stdout
        assert "dashboard:  http://" in status.stdout

        stopped = lorarl("stop", "quickstart", *where, env=env)
        assert stopped.returncode == 0, stopped.stderr
        assert proc.wait(30) == 130
    assert "continues from the checkpoint of step" in stopped.stdout
    assert not processes_of(run_dir), processes_of(run_dir)  # every child stopped too
    step_at_stop = run_files.read_progress(run_dir).step
    assert step_at_stop < 6
    listed = json.loads(lorarl("list", *where, "--json", env=env).stdout)
    assert [(r["name"], r["phase"]) for r in listed] == [("quickstart", "Stopped")]

    resumed = lorarl("resume", "quickstart", *where, "--status-port", "-1", env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming quickstart in" in resumed.stdout
    progress = run_files.read_progress(run_dir)
    assert progress.phase == "Succeeded" and progress.step == 6
    done = lorarl("status", "quickstart", *where, env=env).stdout
    assert done.startswith("quickstart · Succeeded · step 6/6 · reward ")
    log = lorarl("logs", "quickstart", *where, env=env).stdout
    assert "resumed from" in log  # the trainer continued the checkpoint, not step 0
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
