"""`lorarl run examples/quickstart.yaml --local` for real: vLLM engines (under the engine
interpreter), sync sidecars, 2 trainer ranks under torchrun, the status API; and nothing left
running afterwards.

Both runs are `long` (make test-long: ~2.5 min each here). What make test keeps of them: the
README's quickstart block runs `lorarl run examples/quickstart.yaml --local` (merged) as a user
does; adapter sync on real vLLM in tests/e2e/test_vllm_sync_exact.py and the cluster's colocated
job; evals, trackers, samples and the dashboard in tests/e2e/test_trainer_rl_correctness.py; a
rollout pod killed mid-run in tests/e2e/test_cluster_chaos.py; a restarted engine and a restarted
sidecar caught up in tests/integration/test_multi_receiver.py."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from peft import PeftModel
from transformers import AutoModelForCausalLM

from harness.cluster.jobs import prepare_assets
from harness.services.browser import (
    ARGS,
    CHROMIUM,
    REFRESH_README_PICTURE,
    SCREENSHOT,
    point_steps,
    wait_for_step,
)
from harness.services.server_live import live_server
from lorarl.api.reports import run_files
from lorarl.api.validation import load_job_file
from lorarl.local import LocalRun
from lorarl.server.app import create_app
from lorarl.server.stores.local import LocalStore

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


@pytest.fixture(scope="module", autouse=True)
def quickstart_assets():
    prepare_assets()  # `lorarl prepare quickstart`, once per test process


@pytest.fixture(autouse=True)
def in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the quickstart's paths are relative to the repository


def quickstart(sync_mode: str, steps: int = 30):
    job = load_job_file(QUICKSTART)
    job.spec.rollout.sync_mode = sync_mode
    job.spec.training.total_steps = steps
    return job


def gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def check_finished_run(run: LocalRun, result, steps: int = 30) -> None:
    assert result.progress.phase == "Succeeded" and result.progress.step == steps
    store = LocalStore()
    store.add(run.job, run.progress_url, run_dir=run.run_dir)  # trainer gone: read its files
    check_learned(store, run.job, run.run_dir, steps)


def check_learned(store: LocalStore, job, run_dir: Path, steps: int) -> None:
    """The REST API serves every step; the reward rose; the adapter loads onto the base model."""
    metrics = TestClient(create_app(store)).get("/v1/jobs/local/quickstart/metrics").json()
    served = metrics["steps"]
    assert [s["step"] for s in served] == list(range(1, steps + 1))
    rewards = [s["rewardMean"] for s in served]
    assert statistics.mean(rewards[-10:]) > statistics.mean(rewards[:3]) + 0.1, rewards
    base = AutoModelForCausalLM.from_pretrained(job.spec.model.path)
    PeftModel.from_pretrained(base, run_dir / "adapter")


def processes_of(run_dir: Path) -> set[int]:
    """Live processes whose command line or environment names `run_dir`: every child of a local
    run (its config, TMPDIR and outputs are there) and whatever those start."""
    mark = str(run_dir).encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
            seen = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except (OSError, IndexError):
            continue
        if state != "Z" and mark in seen:
            found.add(int(entry.name))
    return found


@pytest.mark.long
def test_quickstart_merged_survives_an_engine_kill(tmp_path: Path, engine_python: str):
    # Long enough for a killed vLLM to restart (~30-50 s here) while training goes on.
    job = quickstart("merged", steps=60)
    with LocalRun(job, tmp_path / "run", engine_python=engine_python) as run:
        run.start()
        engine = next(c for c in run.children if c.name == "quickstart-rollout-0-engine")
        deadline = time.monotonic() + 600
        while (p := run.progress()) is None or p.step < 3:
            assert run.trainer.poll() is None, run.trainer.tail()
            assert time.monotonic() < deadline
            time.sleep(0.5)
        first_pid = engine.pid
        os.killpg(first_pid, signal.SIGKILL)
        # The other replica's sidecar is killed outright too: it restarts, re-registers and the
        # trainer brings it to the latest version, without a trainer restart.
        sidecar = next(c for c in run.children if c.name == "quickstart-rollout-1-sidecar")
        while (p := run.progress()) is None or p.step < 6:
            assert run.trainer.poll() is None, run.trainer.tail()
            assert time.monotonic() < deadline
            time.sleep(0.5)
        os.killpg(sidecar.pid, signal.SIGKILL)
        result = run.wait(timeout_s=900)
        children = [c.pid for c in run.children]
    assert engine.restarts == 1 and engine.pid != first_pid
    assert sidecar.restarts == 1
    sidecar_log = (run.run_dir / "logs" / "quickstart-rollout-0-sidecar.log").read_text()
    assert "engine down: v" in sidecar_log  # updates while it was down were kept...
    assert "engine restarted; re-applied" in sidecar_log  # ...and delivered when it came back
    trainer_log = (run.run_dir / "logs" / "quickstart-trainer-0-trainer.log").read_text()
    assert "generating on 1 of 2 engines" in trainer_log
    assert "re-sent version" in trainer_log  # the restarted sidecar was caught up
    check_finished_run(run, result, steps=60)
    history = [
        json.loads(line) for line in (run.run_dir / "history.jsonl").read_text().splitlines()
    ]
    last = history[-1]
    assert set(last["engineRequests"]) == {"rollout-0", "rollout-1"}, last["engineRequests"]
    assert all(n > 0 for n in last["engineRequests"].values()) and last["syncMembers"] == 2
    # by replica name like the requests; each serves the trained weights (the task is learned)
    assert set(last["engineRewards"]) == {"rollout-0", "rollout-1"}, last["engineRewards"]
    # over the last 10 steps: one step's few samples per engine can land on 0.5 by chance
    tail = [r.get("engineRewards") or {} for r in history[-10:]]
    names = last["engineRewards"]
    means = {name: sum(r.get(name, 0.0) for r in tail) / len(tail) for name in names}
    assert all(m > 0.6 for m in means.values()), tail
    assert all(0 < r["cpuUtil"] <= 1 for r in history), [r.get("cpuUtil") for r in history]
    assert all(gone(pid) for pid in [*children, first_pid]), "a child outlived the run"


def check_dashboard_of_finished_run(job, run_dir: Path, steps: int) -> None:
    """Headless Chromium on the finished run's dashboard: every step on the reward, response
    length, tokens/s and sync-time charts; a screenshot, which becomes the README's picture
    (bench/results/dashboard.png) with LORARL_README_PICTURE=1."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium not installed: apt-get install -y chromium")
    store = LocalStore()
    store.add_finished(job, run_dir)
    with live_server(create_app(store)) as url, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{url}/?job=local/quickstart")
        wait_for_step(page, "reward", steps, timeout=30_000)
        for chart in ("reward", "length", "tps", "sync"):
            assert point_steps(page, chart) == list(range(1, steps + 1)), chart
        box = page.locator("#chart-reward .u-over").bounding_box()  # hover: the picture shows
        x = page.evaluate(f"lorarlCharts.reward.valToPos({steps - 5}, 'x')")  # a step's values
        page.mouse.move(box["x"] + x, box["y"] + box["height"] / 2)
        shown = page.locator("#chart-reward .u-legend .u-series .u-value").all_text_contents()
        assert shown[0] == str(steps - 5) and shown[1] != "–", shown
        shot = SCREENSHOT if REFRESH_README_PICTURE else run_dir / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot


INTERVAL = 20  # evals and samples: after step 20 (and evals after the last step, 30)


@pytest.mark.long
def test_cli_runs_the_quickstart_in_adapter_mode(tmp_path: Path, engine_python: str):
    """`lorarl run --local` on the quickstart with adapter sync: it learns over its 30 steps,
    evals, TensorBoard, samples and the dashboard work, and nothing is left running. One run for
    all of it: the engines' start-up is most of a quickstart's time."""
    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["spec"]["rollout"]["syncMode"] = "adapter"
    steps = doc["spec"]["training"]["totalSteps"]
    # Evals before training, after step 20 and after the last step. The quickstart's task has
    # only 8 prompts ("after a".."after h"), so these are training prompts (and the trainer says
    # so): this checks the plumbing, not generalization.
    train_file = ROOT / doc["spec"]["data"]["trainFiles"][0]
    rows = {json.loads(line)["prompt"]: line for line in train_file.read_text().splitlines()}
    val_file = tmp_path / "val.jsonl"
    val_file.write_text("".join(line + "\n" for _, line in sorted(rows.items())))
    doc["spec"]["data"]["valFiles"] = [str(val_file)]
    doc["spec"]["training"].update(
        evalInterval=INTERVAL, evalBeforeTrain=True, eval={"n": 4, "temperature": 1.0}
    )
    doc["spec"]["training"].update(samplesInterval=INTERVAL, samplesPerStep=3)  # check_tracking
    doc["spec"]["logging"] = {"backends": ["tensorboard"]}
    job_file = tmp_path / "adapter.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lorarl.cli.main", "run", str(job_file), "--local",
             "--run-dir", str(run_dir), "--status-port", "0"],
            cwd=ROOT, stdout=stdout, stderr=stderr, text=True,
            env={**os.environ, "LORARL_ENGINE_PYTHON": engine_python, "COLUMNS": "120"},
        )  # fmt: skip
        most_alive, deadline = 0, time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            most_alive = max(most_alive, len(processes_of(run_dir)))  # so the check below can fail
            time.sleep(1)
        if proc.poll() is None:
            proc.kill()
    output = out.read_text()
    assert proc.wait(30) == 0, output[-3000:] + err.read_text()[-3000:]
    assert "status API and dashboard: http://127.0.0.1:" in output
    assert "reward" in output and "adapter:" in output
    # 2 engines, 2 sidecars, torchrun and its 2 ranks while it ran; none of them after.
    assert most_alive >= 7 and not processes_of(run_dir), (most_alive, processes_of(run_dir))
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()

    job = load_job_file(job_file)
    progress = run_files.read_progress(run_dir)
    assert progress.phase == "Succeeded" and progress.step == steps
    store = LocalStore()
    store.add_finished(job, run_dir)
    check_learned(store, job, run_dir, steps)
    check_evals(job, run_dir, output, steps)
    trainer_log = (run_dir / "logs" / "quickstart-trainer-0-trainer.log").read_text()
    assert "8 of 8 validation prompts are also training prompts" in trainer_log
    assert progress.last_sync is not None and progress.last_sync.mode == "adapter"
    check_tracking(job, run_dir)
    check_dashboard_of_finished_run(job, run_dir, steps)


def check_evals(job, run_dir: Path, stdout: str, steps: int) -> None:
    """The evals are in the step history, the progress file, the summary and the REST API."""
    history = run_files.read_history(run_dir)
    assert [r.step for r in history if r.eval] == [INTERVAL, steps]
    for r in history:
        assert r.eval is None or (r.eval.prompts, r.eval.samples_per_prompt) == (8, 4)
        assert r.eval is None or list(r.eval.pass_at_k) == ["1", "2", "4"]
    progress = run_files.read_progress(run_dir)
    assert progress.baseline_eval.step == 0 and progress.eval == history[-1].eval
    assert "eval before training: accuracy" in stdout
    assert f"final eval step {steps}: accuracy" in stdout
    store = LocalStore()
    store.add_finished(job, run_dir)
    detail = TestClient(create_app(store)).get("/v1/jobs/local/quickstart").json()
    assert detail["status"]["eval"] == history[-1].eval.wire()
    assert detail["status"]["baselineEval"]["step"] == 0


def check_tracking(job, run_dir: Path) -> None:
    """spec.logging's TensorBoard files (read with TensorBoard's own reader) hold every step and
    every eval; samples.jsonl holds samplesPerStep decoded samples of each samplesInterval step,
    which the REST API serves."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history = run_files.read_history(run_dir)
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    reward = {e.step: e.value for e in acc.Scalars("reward_mean")}
    assert reward == pytest.approx({r.step: r.reward_mean for r in history})
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [0, INTERVAL, history[-1].step]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [INTERVAL] * 3
    for s in samples:
        assert s["prompt"] and s["finish_reason"] in ("stop", "length")
        assert isinstance(s["reward"], float) and isinstance(s["advantage"], float)
    (text,) = acc.Tensors("samples/text_summary")
    store = LocalStore()
    store.add_finished(job, run_dir)
    served = TestClient(create_app(store)).get("/v1/jobs/local/quickstart/samples").json()
    assert [(s["step"], s["completion"]) for s in served["samples"]] == [
        (s["step"], s["completion"]) for s in samples
    ]
    shown = samples[0]["prompt"][:20].replace("|", "\\|").replace("\n", "<br>")
    assert text.step == INTERVAL and shown in text.tensor_proto.string_val[0].decode()
