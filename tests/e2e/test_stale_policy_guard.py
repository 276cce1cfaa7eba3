"""The stale-policy guard against an engine that silently keeps old weights, with real vLLM.

`lorarl run --local` on the quickstart (two vLLM engines, sidecars, two trainer ranks), where the
sidecar of rollout-1 acknowledges every update without pushing it (`harness/chaos/lazy_sidecar`:
its `/healthz` says it serves the latest version, its engine keeps the start weights). Without
the guard the trainer generates from rollout-1 at every step and trains on samples of the start
policy labelled with the current version. With it: the first version whose update is visible on
the probe is refused on rollout-1, re-sent, refused again, and the job stops naming rollout-1
before any sample of that version is generated; rollout-0 passes every check. In adapter mode
the first version is already refused: the engine answers 404 for an adapter it never loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.cluster.jobs import prepare_assets
from lorarl.api.reports import run_files

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
LAZY = ROOT / "harness" / "chaos" / "lazy_sidecar"


@pytest.fixture(scope="module", autouse=True)
def quickstart_assets():
    prepare_assets()


def run_quickstart(tmp_path: Path, engine_python: str, sync_mode: str, lazy: str) -> Path:
    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["spec"]["rollout"]["syncMode"] = sync_mode
    doc["spec"]["training"]["totalSteps"] = 8
    doc["spec"]["optim"]["warmupSteps"] = 0  # the first update is already visible on the probe
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "LORARL_ENGINE_PYTHON": engine_python,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(LAZY), os.environ.get("PYTHONPATH")])),
        "LORARL_TEST_LAZY_SIDECAR": lazy,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "lorarl.cli.main", "run", str(job_file), "--local",
         "--run-dir", str(run_dir), "--status-port", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode != 0, "the job trained on a stale engine to the end"
    return run_dir


# adapter mode is `long` (make test-long): the guard is the same code, the probe differs only in
# the model name it asks for (tests/unit/trainer/fleet/test_sync_check.py).
@pytest.mark.parametrize("sync_mode", ["merged", pytest.param("adapter", marks=pytest.mark.long)])
def test_an_engine_that_never_receives_the_update_stops_the_job_by_name(
    tmp_path: Path, engine_python: str, sync_mode: str
) -> None:
    run_dir = run_quickstart(tmp_path, engine_python, sync_mode, lazy="1")
    progress = run_files.read_progress(run_dir)
    assert progress.phase == "Failed"
    message = progress.message or ""
    assert "rollout-1" in message and "after a re-sync" in message, message
    assert "rollout-0" not in message
    version = int(message.split("does not serve weight version ")[1].split()[0])
    if sync_mode == "adapter":  # the engine never heard of the adapter's name: from the start
        assert version == 0 and "HTTP 404" in message and "lorarl-v0" in message, message
    else:  # the start weights are version 0's; the first visible update is refused
        assert version >= 1 and "per token" in message, message
    path = run_dir / "history.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    history = [json.loads(line) for line in lines if line.strip()]
    # The steps before the refused version trained; the one that would have generated from it
    # never did: no sample of a version rollout-1 could not show was generated anywhere.
    assert [r["step"] for r in history] == list(range(1, version + 1))
    assert all(r["syncCheckSeconds"] > 0 for r in history)
    for record in history:  # both replicas generated from weights they really held
        by_replica = record["logprobMismatchByReplica"]
        assert set(by_replica) == {"rollout-0", "rollout-1"}, by_replica
        assert all(gap < 2e-3 for gap in by_replica.values()), by_replica
    trainer_log = (run_dir / "logs" / "quickstart-trainer-0-trainer.log").read_text()
    assert "rollout-1 (" in trainer_log and "re-syncing it" in trainer_log
    sidecar_log = (run_dir / "logs" / "quickstart-rollout-1-sidecar.log").read_text()
    assert f"applied v{version}" in sidecar_log  # it did say so
