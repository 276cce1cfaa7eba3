"""`lorarl list/status/logs/stop/resume/delete/dashboard --local` against run folders as a
session writes them (progress.json, history.jsonl, manifest.yaml, run.json, logs/), with real
processes standing in for `lorarl run` where a command signals or waits for one."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from lorarl.api.reports import run_files
from lorarl.api.reports.progress import Progress, StepRecord
from lorarl.api.reports.status import EvalRecord
from lorarl.api.validation import load_job_file
from lorarl.cli.main import main
from lorarl.cli.runs import dashboard_store
from lorarl.local import runs
from lorarl.server.app import create_app

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"

# What `lorarl run --local` does with its run folder, minus the children: record the manifest and
# its pid, log, and on SIGTERM (as session.py: the same path as Ctrl-C) record exit code 130.
FAKE_RUN = """
import signal, sys, time
from pathlib import Path
from lorarl.api.validation import load_job_file
from lorarl.local.runs import record_end, record_start

def interrupt(*args):
    raise KeyboardInterrupt

signal.signal(signal.SIGTERM, interrupt)
run_dir, lines = Path(sys.argv[1]), int(sys.argv[3])
record_start(run_dir, load_job_file(sys.argv[2]))
log = run_dir / "logs" / "quickstart-trainer-0-trainer.log"
log.parent.mkdir(exist_ok=True)
code = 0
try:
    for i in range(lines):
        with open(log, "a") as f:
            f.write(f"step line {i}\\n")
        time.sleep(0.02)
    while sys.argv[4] == "forever":
        time.sleep(0.02)
except KeyboardInterrupt:
    code = 130
record_end(run_dir, code)
"""


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input)


def one_line_error(result) -> str:
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def make_run(
    runs_dir: Path,
    name: str,
    *,
    phase: str,
    step: int,
    exit_code: int | None,
    checkpoints: tuple[int, ...] = (),
    evaluated: bool = False,
) -> Path:
    """A run folder as a session and its trainer leave it."""
    job = load_job_file(QUICKSTART)
    job.metadata.name = name
    run_dir = runs_dir / name
    runs.record_start(run_dir, job)
    now = time.time()
    records = [
        StepRecord(step=s, time=now, reward_mean=0.1 * s, reward_std=0.05, kl=0.001 * s)
        for s in range(1, step + 1)
    ]
    for r in records:
        run_files.append_history(run_dir, r)
    ev = EvalRecord(
        step=step, reward_mean=0.7, accuracy=0.6875, pass_at_k={"1": 0.6875}, prompts=8,
        samples_per_prompt=2, seconds=1.5,
    ) if evaluated else None  # fmt: skip
    progress = Progress(
        job=name, phase=phase, step=step, total_steps=30, latest=records[-1] if records else None,
        eval=ev, message=f"{phase.lower()} at step {step}", started_at=now - 125, updated_at=now,
    )  # fmt: skip
    run_files.write_progress(run_dir, progress)
    for s in checkpoints:
        (run_dir / "checkpoints" / f"step-{s:06d}").mkdir(parents=True)
    if exit_code is not None:
        runs.record_end(run_dir, exit_code)
    return run_dir


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    d = tmp_path / "runs"
    make_run(d, "done", phase="Succeeded", step=30, exit_code=0, checkpoints=(30,), evaluated=True)
    make_run(d, "halted", phase="Running", step=12, exit_code=130, checkpoints=(10,))
    make_run(d, "crashed", phase="Running", step=3, exit_code=1)
    return d


def test_list_shows_phase_steps_reward_eval_and_age(runs_dir: Path):
    result = invoke("list", "--local", "--runs-dir", str(runs_dir))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "STEPS", "REWARD", "EVAL", "AGE", "PID"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["done"] == ["done", "Succeeded", "30/30", "3.000", "0.688", "2m"]
    # progress.json still says Running, but the process is gone: how it ended decides
    assert rows["halted"][:5] == ["halted", "Stopped", "12/30", "1.200", "-"]
    assert rows["crashed"][:2] == ["crashed", "Failed"]

    data = json.loads(invoke("list", "--local", "--runs-dir", str(runs_dir), "--json").output)
    by_name = {r["name"]: r for r in data}
    assert by_name["halted"]["checkpointSteps"] == [10] and by_name["halted"]["pid"] is None
    assert by_name["done"]["evalAccuracy"] == 0.6875 and by_name["done"]["totalSteps"] == 30


def test_list_of_no_runs(tmp_path: Path):
    result = invoke("list", "--local", "--runs-dir", str(tmp_path / "none"))
    assert result.exit_code == 0 and "no runs under" in result.output


def test_status_prints_the_progress_line_conditions_and_last_eval(runs_dir: Path):
    result = invoke("status", "done", "--local", "--runs-dir", str(runs_dir))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "done · Succeeded · step 30/30 · reward 3.000 ± 0.050 · kl 0.0300"
    assert "Succeeded=True Succeeded: succeeded at step 30" in result.output
    assert "last eval step 30: accuracy 0.688, reward 0.700, pass@1 0.688" in result.output
    assert f"local run in {runs_dir / 'done'}, not running; checkpoints at steps 30" in lines[1]

    halted = invoke("status", "halted", "--local", "--runs-dir", str(runs_dir)).output
    assert halted.startswith("halted · Stopped · step 12/30")
    assert "Stopped=True Stopped: stopped (Ctrl-C or `lorarl stop`)" in halted
    assert "last eval:  none yet" in halted

    as_json = invoke("status", "done", "--local", "--runs-dir", str(runs_dir), "--json")
    data = json.loads(as_json.output)
    assert data["phase"] == "Succeeded" and data["status"]["eval"]["accuracy"] == 0.6875
    assert data["status"]["columns"] == {"steps": "30/30", "reward": "3.000", "eval": "0.688"}


@pytest.mark.parametrize("command", ["status", "logs", "stop", "resume", "delete"])
def test_an_unknown_run_is_one_line_naming_the_runs(runs_dir: Path, command: str):
    line = one_line_error(invoke(command, "dne", "--local", "--runs-dir", str(runs_dir)))
    assert line == f"Error: no run named 'dne' under {runs_dir}/; runs: crashed, done, halted"


def test_local_with_cluster_options_is_a_usage_error(runs_dir: Path):
    result = invoke("list", "--local", "-n", "team-a")
    assert result.exit_code == 2 and "--namespace/--kubeconfig are for a cluster" in result.output


def test_logs_by_role_prefixed_when_several(runs_dir: Path):
    logs = runs_dir / "done" / "logs"
    logs.mkdir()
    (logs / "done-trainer-0-trainer.log").write_text("trainer says hi\nlast line, no newline")
    (logs / "done-rollout-0-engine.log").write_text("engine 0 up\n")
    (logs / "done-rollout-1-engine.log").write_text("engine 1 up\n")
    (logs / "done-rollout-0-sidecar.log").write_text("sidecar 0 applied v3\n")
    args = ("--local", "--runs-dir", str(runs_dir))
    assert invoke("logs", "done", *args).output == "trainer says hi\nlast line, no newline\n"
    assert invoke("logs", "done", "--role", "rollout", *args).output == (
        "[done-rollout-0-engine] engine 0 up\n[done-rollout-1-engine] engine 1 up\n"
    )
    assert invoke("logs", "done", "--role", "sidecar", *args).output == "sidecar 0 applied v3\n"
    line = one_line_error(invoke("logs", "done", "--role", "reward", *args))
    assert "has no reward logs" in line and "roles with logs: trainer, rollout, sidecar" in line


def fake_run(tmp_path: Path, runs_dir: Path, lines: int, mode: str) -> subprocess.Popen:
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    run_dir = runs_dir / "quickstart"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run_dir), str(QUICKSTART), str(lines), mode], cwd=ROOT
    )
    deadline = time.monotonic() + 30
    while runs.live_pid(runs.read_state(run_dir)) is None:
        assert proc.poll() is None and time.monotonic() < deadline, "the fake run did not start"
        time.sleep(0.02)
    return proc


def test_logs_follow_until_the_run_ends(tmp_path: Path):
    runs_dir = tmp_path / "runs"
    proc = fake_run(tmp_path, runs_dir, lines=40, mode="end")
    result = invoke("logs", "quickstart", "-f", "--local", "--runs-dir", str(runs_dir))
    assert proc.wait(30) == 0
    # every line, including those written after `logs -f` started, and it returned by itself
    assert result.exit_code == 0, result.output
    assert result.output == "".join(f"step line {i}\n" for i in range(40))


def test_stop_sigterms_the_run_which_records_how_it_ended(tmp_path: Path):
    runs_dir = tmp_path / "runs"
    proc = fake_run(tmp_path, runs_dir, lines=0, mode="forever")
    args = ("--local", "--runs-dir", str(runs_dir))
    listed = invoke("list", *args).output.splitlines()[1].split()
    assert listed[1] == "Pending" and listed[-1] == str(proc.pid)  # no progress.json yet
    # a running run is neither deleted nor resumed
    assert "is running (pid" in one_line_error(invoke("delete", "quickstart", "-y", *args))
    assert "still running" in one_line_error(invoke("resume", "quickstart", *args))

    result = invoke("stop", "quickstart", *args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"stopped quickstart (pid {proc.pid}); `lorarl resume")
    assert "at step 0 (no checkpoint)" in result.output
    assert proc.wait(5) == 0  # it ended through its own stop path, not killed
    assert runs.read_state(runs_dir / "quickstart")["exitCode"] == 130
    line = one_line_error(invoke("stop", "quickstart", *args))
    assert line == "Error: run 'quickstart' is not running (nothing to stop)"


def test_resume_runs_the_saved_manifest_in_its_folder(runs_dir: Path, monkeypatch):
    calls = []

    def run_local(job, **kwargs):
        calls.append((job, kwargs))
        return 0

    monkeypatch.setattr("lorarl.local.session.run_local", run_local)
    args = ("--local", "--runs-dir", str(runs_dir))
    result = invoke("resume", "halted", *args, "--status-port", "-1")
    assert result.exit_code == 0, result.output
    said = f"resuming halted in {runs_dir / 'halted'} from the checkpoint of step 10"
    assert said in result.output
    (job, kwargs), = calls  # fmt: skip
    assert job.name == "halted" and job.spec.training.total_steps == 30
    assert kwargs["run_dir"] == str(runs_dir / "halted") and kwargs["existing"] == "resume"
    assert kwargs["status_port"] == -1
    line = one_line_error(invoke("resume", "done", *args))
    assert line == "Error: run 'done' finished (30/30 steps); nothing to resume"
    (runs_dir / "halted" / runs.MANIFEST_FILE).unlink()
    line = one_line_error(invoke("resume", "halted", *args))
    assert "has no manifest.yaml" in line and "--run-dir" in line


def test_delete_asks_unless_yes(runs_dir: Path):
    args = ("--local", "--runs-dir", str(runs_dir))
    result = invoke("delete", "done", *args, input="n\n")
    assert result.exit_code == 1 and (runs_dir / "done").is_dir()
    result = invoke("delete", "done", *args, input="y\n")
    assert result.exit_code == 0 and not (runs_dir / "done").exists()
    assert invoke("delete", "halted", "-y", *args).exit_code == 0
    assert runs.run_names(runs_dir) == ["crashed"]


def test_dashboard_serves_past_runs_from_their_folders(runs_dir: Path):
    (runs_dir / "old").mkdir()
    run_files.write_progress(runs_dir / "old", Progress(job="old", phase="Running", total_steps=3))
    store, skipped = dashboard_store(runs_dir)
    assert len(skipped) == 1 and skipped[0].startswith("skipped old:")
    client = TestClient(create_app(store, loopback_only=True), base_url="http://127.0.0.1")
    jobs = {j["name"]: j for j in client.get("/v1/jobs").json()["items"]}
    assert set(jobs) == {"done", "halted", "crashed"}
    assert jobs["done"]["phase"] == "Succeeded" and jobs["done"]["step"] == 30
    metrics = client.get("/v1/jobs/local/halted/metrics").json()
    assert [s["step"] for s in metrics["steps"]] == list(range(1, 13))
    assert client.get("/").status_code == 200


def test_the_commands_on_a_cluster_act_through_its_api(tmp_path: Path):
    """list, status, stop, resume, logs and delete against a real API server (no operator: the
    test writes the status the operator would, through the status subresource)."""
    from harness.cluster.controlplane import control_plane
    from lorarl.cluster import Cluster

    with control_plane(tmp_path / "cp", controllers=False, scheduler=False) as cp:
        cp.apply_crds(ROOT / "crds" / "lorarljobs.lorarl.dev.yaml")
        kc = ("--kubeconfig", str(cp.kubeconfig_path))
        assert invoke("list", *kc).output == "no LoRARLJobs in namespace 'default'\n"
        assert invoke("run", str(QUICKSTART), *kc).exit_code == 0
        row = invoke("list", *kc).output.splitlines()[1].split()
        assert row[:3] == ["quickstart", "-", "0/30"]  # not reconciled: the spec's total

        cluster = Cluster(None, str(cp.kubeconfig_path))
        status = {
            "phase": "Running", "step": 12, "totalSteps": 30,
            "metrics": {"rewardMean": 0.41236},
            "conditions": [{"type": "Running", "status": "True", "reason": "Running",
                            "message": "step 12", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
            "eval": {"step": 10, "rewardMean": 0.5, "accuracy": 0.6875, "prompts": 8,
                     "samplesPerPrompt": 2, "seconds": 1.0},
            "columns": {"steps": "12/30", "reward": "0.412", "eval": "0.688"},
        }  # fmt: skip
        cluster.custom.patch_namespaced_custom_object_status(
            "lorarl.dev", "v1alpha1", "default", "lorarljobs", "quickstart", {"status": status}
        )
        printed = cp.kubectl_ok("get", "lrj").splitlines()
        assert printed[0].split() == ["NAME", "PHASE", "STEPS", "REWARD", "EVAL", "AGE"]
        assert printed[1].split()[:5] == ["quickstart", "Running", "12/30", "0.412", "0.688"]

        out = invoke("status", "quickstart", *kc).output
        assert out.splitlines()[0] == "quickstart · Running · step 12/30 · reward 0.412"
        assert "Running=True Running: step 12" in out and "last eval step 10: accuracy 0.688" in out
        as_json = json.loads(invoke("status", "quickstart", "--json", *kc).output)
        assert as_json["status"]["step"] == 12

        assert invoke("stop", "quickstart", *kc).exit_code == 0
        spec = json.loads(cp.kubectl_ok("get", "lrj", "quickstart", "-o", "json"))["spec"]
        assert spec["runPolicy"]["suspend"] is True
        assert invoke("resume", "quickstart", *kc).exit_code == 0
        spec = json.loads(cp.kubectl_ok("get", "lrj", "quickstart", "-o", "json"))["spec"]
        assert spec["runPolicy"]["suspend"] is False
        line = one_line_error(invoke("resume", "quickstart", *kc))
        assert line == "Error: job 'quickstart' is not suspended (Running); nothing to resume"

        line = one_line_error(invoke("logs", "quickstart", "--role", "sidecar", *kc))
        assert "job 'quickstart' has no rollout pods in namespace 'default' now" in line
        line = one_line_error(invoke("status", "nope", *kc))
        assert line == "Error: no LoRARLJob named 'nope' in namespace 'default'; jobs: quickstart"

        assert invoke("delete", "quickstart", "-y", *kc).output == (
            'lorarljob.lorarl.dev "quickstart" deleted\n'
        )
        assert not cp.kubectl_ok("get", "lrj").strip()  # "No resources found" is on stderr
