"""spec.agent end to end: a plain openai-SDK agent function drives the episodes of a local run
(2 gloo trainer ranks, 2 test engines behind sync sidecars, merged sync every step); every call
it makes is recorded with the engine's own token ids, so the trainer's logprobs of them match
the engine's on every step."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from harness.workloads.local_jobs import LETTERS, hf_engine, letter_job, read_history
from harness.workloads.tiny_models import taught_letter_model
from lorarl.local import LocalRun

pytestmark = pytest.mark.slow

STEPS = 4


def test_an_openai_sdk_agent_trains_token_exact(tmp_path: Path):
    taught_letter_model(tmp_path / "model", LETTERS)
    training = {"totalSteps": STEPS, "promptsPerStep": 4, "microBatchSize": 16,
                "checkpointInterval": 10, "samplesInterval": 2}  # fmt: skip
    agent = {"entrypoint": "harness.workloads.letter_agent:run", "maxConcurrency": 8,
             "timeoutSeconds": 60}  # fmt: skip
    job = letter_job(tmp_path, training=training, agent=agent, reward=None)
    engine = functools.partial(hf_engine, model=job.spec.model.path)
    with LocalRun(job, tmp_path / "run", engine_command=engine) as run:
        run.start()
        result = run.wait(timeout_s=600)
    assert result.progress is not None and result.progress.phase == "Succeeded"
    history = read_history(tmp_path / "run")
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    # Token-exact: the recorded completion ids are the engine's own, so the trainer's logprobs
    # of them (after the prompt the endpoint rendered) are the engine's.
    assert max(h["logprobMismatch"] for h in history) < 1e-4
    assert all(h["failedEpisodes"] == 0 and h["turnsMean"] == 1.0 for h in history)
    assert all(set(h["rewardMetrics"]) == {"replied"} for h in history)  # the agent's metrics
    rows = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert rows and all(row["prompt"] for row in rows)


def test_ppo_trains_an_agent_with_call_rewards_and_an_excluded_role(tmp_path: Path):
    """ppo with a LoRA critic on a merged two-call conversation: the agent's call rewards sit on
    their calls' last tokens (GAE carries them back), the excluded 'helper' role is masked out."""
    taught_letter_model(tmp_path / "model", LETTERS)
    agent = {"entrypoint": "harness.workloads.letter_agent:ppo_turns", "trajectory": "merged",
             "excludeRoles": ["helper"], "timeoutSeconds": 60}  # fmt: skip
    job = letter_job(
        tmp_path, agent=agent, reward=None,
        algorithm={"name": "ppo", "groupSize": 4}, critic={"optim": {"lr": 5e-3}},
        training={"totalSteps": 2, "promptsPerStep": 4, "microBatchSize": 16,
                  "checkpointInterval": 10, "samplesInterval": 1},
    )  # fmt: skip
    engine = functools.partial(hf_engine, model=job.spec.model.path)
    with LocalRun(job, tmp_path / "run", engine_command=engine) as run:
        run.start()
        result = run.wait(timeout_s=600)
    assert result.progress is not None and result.progress.phase == "Succeeded", result
    history = read_history(tmp_path / "run")
    assert [h["step"] for h in history] == [1, 2]
    assert all(h["valueLoss"] is not None and h["criticGradNorm"] > 0 for h in history)
    assert all(h["turnsMean"] == 2.0 and h["failedEpisodes"] == 0 for h in history)
    assert max(h["logprobMismatch"] for h in history) < 1e-4
