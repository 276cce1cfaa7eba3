"""Checks of a finished local run against issue 14's "done when": the evals reach every place a
person reads them (history, progress, REST API, dashboard, TensorBoard, MLflow, W&B), and the
merged export serves in vLLM with the PEFT model's logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from harness.engines.vllm_serve import greedy_with_logprobs, vllm_serving
from harness.services.browser import ARGS, CHROMIUM
from harness.services.server_live import live_server
from harness.services.wandb_files import wandb_history
from lorarl.api import LoRARLJob
from lorarl.api.reports import run_files
from lorarl.server.app import create_app
from lorarl.server.stores.local import LocalStore
from lorarl.trainer.telemetry.tracking import IDS_FILE

# fp32 on both sides, different kernels: fp32 noise (the sync tests allow 1e-3 per token).
MAX_MEAN_GAP = 1e-4
MAX_GAP = 1e-3


def check_evals_served(job: LoRARLJob, run_dir: Path, eval_steps: list[int], prompts: int):
    """The evals are in the step history and the progress file, and the REST API's job detail
    serves the latest one and the one before training."""
    history = run_files.read_history(run_dir)
    assert [r.step for r in history if r.eval] == eval_steps[1:]
    for r in history:
        assert r.eval is None or (r.eval.step, r.eval.prompts) == (r.step, prompts)
    progress = run_files.read_progress(run_dir)
    assert progress.baseline_eval is not None and progress.baseline_eval.step == eval_steps[0]
    assert progress.eval == history[-1].eval
    print("evals:", [(e.step, e.accuracy) for e in [progress.baseline_eval, *
                     (r.eval for r in history if r.eval)]])  # fmt: skip
    store = LocalStore()
    store.add_finished(job, run_dir)
    detail = TestClient(create_app(store)).get(f"/v1/jobs/local/{job.name}").json()
    assert detail["status"]["eval"] == history[-1].eval.wire()
    assert detail["status"]["baselineEval"] == progress.baseline_eval.wire()


def _evals(run_dir: Path) -> dict[int, float]:
    """Eval accuracy by step, as the run's own files say."""
    progress = run_files.read_progress(run_dir)
    got = {r.step: r.eval.accuracy for r in run_files.read_history(run_dir) if r.eval}
    return {progress.baseline_eval.step: progress.baseline_eval.accuracy, **got}


def check_trackers(run_dir: Path, mlflow_url: str, eval_steps: list[int]) -> None:
    """eval/accuracy at every eval step in TensorBoard's event files (TensorBoard's reader), the
    MLflow server's run (MlflowClient) and the W&B offline run file."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    want = _evals(run_dir)
    assert sorted(want) == eval_steps
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("eval/accuracy")} == pytest.approx(want)
    ids = json.loads((run_dir / IDS_FILE).read_text())
    client = MlflowClient(mlflow_url)
    assert client.get_run(ids["mlflow_run_id"]).info.status == "FINISHED"
    got = client.get_metric_history(ids["mlflow_run_id"], "eval/accuracy")
    assert {m.step: m.value for m in got} == pytest.approx(want)
    (run_file,) = (run_dir / "wandb").glob(f"offline-run-*/run-{ids['wandb_run_id']}.wandb")
    steps = wandb_history(run_file)
    wandb_evals = {
        s: items["eval/accuracy"] for s, items in steps.items() if "eval/accuracy" in items
    }
    assert wandb_evals == pytest.approx(want)


def check_dashboard_shows_eval(job: LoRARLJob, run_dir: Path) -> None:
    """Headless Chromium on the finished run's dashboard: the reward chart has an eval accuracy
    series with the run's evals (read from the page's charts, window.lorarlCharts, the hook the
    dashboard's own browser tests use)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium not installed: apt-get install -y chromium")
    store = LocalStore()
    store.add_finished(job, run_dir)
    with live_server(create_app(store)) as url, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{url}/?job=local/{job.name}")
        drawn = page.wait_for_function(
            """() => { const u = (window.lorarlCharts || {}).reward;
                const i = u ? u.series.findIndex((s) => /eval accuracy$/.test(s.label || "")) : -1;
                if (i < 1) return null;
                return u.data[0].map((x, j) => [x, u.data[i][j]])
                    .filter(([, y]) => typeof y === "number"); }""",
            timeout=20_000,
        ).json_value()
        assert f"local/{job.name}" in page.inner_text("body")
        browser.close()
    assert dict(drawn) == pytest.approx(_evals(run_dir))


def _logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """The logprob of every token after the first, fp32."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logp[i - 1, t].item() for i, t in enumerate(ids) if i > 0]


def check_merged_export_in_vllm(
    run_dir: Path, base_dir: Path, val_file: Path, engine_python: str
) -> None:
    """A fresh vLLM (fp32) serves outputDir/merged: its greedy tokens and the logprobs of every
    prompt and sampled token equal the PEFT model's (base + outputDir/adapter) within fp32
    noise, and are far from the base model's (the merge carried the training)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = run_dir / "merged"
    assert (merged / "config.json").is_file(), sorted(p.name for p in run_dir.iterdir())
    tok = AutoTokenizer.from_pretrained(merged)
    question = json.loads(val_file.read_text().splitlines()[0])["prompt"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    with vllm_serving(merged, run_dir.parent / "vllm-merged", engine_python) as url:
        served = greedy_with_logprobs(url, prompt, max_tokens=8)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    ids = prompt + served["tokens"]
    want = _logprobs(peft, ids)
    with peft.disable_adapter():
        far = _logprobs(peft, ids)
    with torch.no_grad():
        greedy = peft(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    assert served["tokens"] == greedy
    got = served["prompt_logprobs"] + served["logprobs"]
    gaps = [abs(a - b) for a, b in zip(got, want, strict=True)]
    base_gaps = [abs(a - b) for a, b in zip(got, far, strict=True)]
    mean_gap, base_gap = sum(gaps) / len(gaps), sum(base_gaps) / len(gaps)
    print(f"merged in vLLM vs PEFT: mean logprob gap {mean_gap:.2e} (max {max(gaps):.1e}); "
          f"vs the base model {base_gap:.2e} (max {max(base_gaps):.1e})")  # fmt: skip
    assert mean_gap <= MAX_MEAN_GAP and max(gaps) <= MAX_GAP
    assert base_gap >= 10 * MAX_MEAN_GAP  # the bound tells the trained model from the base
