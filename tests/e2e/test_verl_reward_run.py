"""A verl reward file in a local run (issue 37 #2): the example file, named by its path the way
a user runs it from the repository, loaded by the trainer process, called with verl's arguments
on verl's parquet, and its dict's numbers averaged into every step of the history.

The tiny model is untrained on GSM8K, so few answers are right; the check that can fail is that
the trainer, the reward and the record agree: with format_score 0.5 a sample's reward is
acc + 0.5 * (formatted - acc), so each step's rewardMean follows from its rewardMetrics.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from harness.workloads.local_jobs import hf_engine, letter_job, read_history
from harness.workloads.verl_data import write_verl_gsm8k
from lorarl.local import LocalRun
from tests.e2e.test_verl_data_run import verl_letter_rows

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def test_the_example_verl_reward_file_runs_and_its_metrics_reach_the_history(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the entrypoint is relative, as in docs/rewards.md
    rows = verl_letter_rows()
    for row in rows:  # numeric answers, so `flexible` extraction has something to compare
        row["reward_model"]["ground_truth"] = str(ord(row["reward_model"]["ground_truth"]) % 10)
    data = write_verl_gsm8k(tmp_path / "train.parquet", rows)
    job = letter_job(
        tmp_path,
        name="verl-reward",
        data={"trainFiles": [str(data)], "answerKey": "reward_model.ground_truth",
              "maxPromptTokens": 32, "maxResponseTokens": 4},
        reward={"entrypoint": "examples/rewards/gsm8k_verl.py:compute_score",
                "params": {"method": "flexible", "format_score": 0.5}},
        training={"totalSteps": STEPS, "promptsPerStep": 4, "microBatchSize": 16,
                  "checkpointInterval": STEPS},
        trainer={"gpusPerReplica": 0, "processesPerReplica": 1},
        rollout={"engine": "vllm", "replicas": 1, "gpusPerReplica": 0, "syncMode": "merged"},
    )  # fmt: skip
    engine = functools.partial(hf_engine, model=job.spec.model.path)
    with LocalRun(job, tmp_path / "run", engine_command=engine) as run:
        run.start()
        result = run.wait(timeout_s=600)
    assert result.progress is not None and result.progress.phase == "Succeeded", result
    history = read_history(tmp_path / "run")
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    for h in history:
        metrics = h["rewardMetrics"]
        assert set(metrics) == {"acc", "formatted"}, h  # `pred` is text: kept, not averaged
        assert 0.0 <= metrics["acc"] <= metrics["formatted"] <= 1.0
        want = metrics["acc"] + 0.5 * (metrics["formatted"] - metrics["acc"])
        assert h["rewardMean"] == pytest.approx(want), h
