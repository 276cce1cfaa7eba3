"""Multi-turn end to end: the tiny model learns a two-turn task whose reward depends on what the
environment says (harness/workloads/letter_relay.py), through the whole loop (2 gloo trainer ranks,
2 engines behind sync sidecars, merged sync every step), with the trainer's logprobs of every
model token matching the engine's on every step. The learning run is `long` (make test-long, 40
steps); make test runs 6 steps of the same job (token-exact, second turns, whole trajectories)."""

from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path

import pytest

from harness.workloads.local_jobs import LETTERS, hf_engine, letter_job, read_history
from harness.workloads.tiny_models import taught_letter_model
from lorarl.local import LocalRun

pytestmark = pytest.mark.slow

# 40, not 20: on PyPI's torch build (the polyglot machines have no +cpu wheel) runs rose only
# +0.08 to +0.15 in 20 steps (CI: 0.169 -> 0.247), short of the +0.15 asked, +0.16 to +0.19 in 30,
# and +0.20 to +0.31 in 40 (two runs each).
LEARNS = 40


@pytest.mark.parametrize(
    "steps",
    [pytest.param(LEARNS, marks=pytest.mark.long, id="learns"), pytest.param(6, id="short")],
)
def test_tiny_model_learns_to_answer_what_the_environment_asks(tmp_path: Path, steps: int) -> None:
    # Taught the letter task's format (a letter, then stop), so episodes reach the second turn;
    # which letter is right it does not know (p = 1/4).
    taught_letter_model(tmp_path / "model", LETTERS)
    training = {"totalSteps": steps, "promptsPerStep": 8, "microBatchSize": 16,
                "checkpointInterval": 10, "samplesInterval": 5}  # fmt: skip
    environment = {
        "entrypoint": "harness.workloads.letter_relay:LetterRelay",
        "maxTurns": 2,
        "maxTotalTokens": 48,
        "finalReward": False,
    }
    # no spec.reward: the environment's reward is the episode's
    job = letter_job(tmp_path, training=training, environment=environment, reward=None)
    engine = functools.partial(hf_engine, model=job.spec.model.path)
    with LocalRun(job, tmp_path / "run", engine_command=engine) as run:
        run.start()
        result = run.wait(timeout_s=600)
    assert result.progress is not None and result.progress.phase == "Succeeded"
    history = read_history(tmp_path / "run")
    assert [h["step"] for h in history] == list(range(1, steps + 1))
    # Token-exact on every step: the model's tokens, scored after the environment's tokens were
    # appended, have the engine's logprobs (a re-tokenized turn would show up here).
    assert max(h["logprobMismatch"] for h in history) < 1e-4
    assert min(h["turnsMean"] for h in history) > 1.5  # most episodes reach the second turn
    assert all(h["environmentSeconds"] >= 0 for h in history)
    r = [h["rewardMean"] for h in history]
    first, last = statistics.mean(r[:5]), statistics.mean(r[-5:])
    if steps == LEARNS:
        assert last > first + 0.15, f"reward did not rise: first five {r[:5]}, last five {r[-5:]}"
    # The samples log holds whole trajectories: the reply, the environment's question, the reply.
    rows = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert rows and any("user: after " in row["completion"] for row in rows), rows[:2]
