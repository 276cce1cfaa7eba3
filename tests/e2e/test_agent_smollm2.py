"""Issue 38, "done when": agents written against the plain `openai` SDK train SmolLM2-135M-Instruct
through lorarl's OpenAI-compatible endpoint (`spec.agent`), on the real local stack (vLLM on CPU,
merged sync after every step), with the reward rising over the run:

- a tool-calling agent (examples/agents/calculator_agent.py): chat completions with `tools=`, the
  model's `<tool_call>` blocks come back as OpenAI `tool_calls`, the agent runs the calculator;
- a two-agent episode (examples/agents/planner_agent.py): a planner writes a message to a solver,
  both the same policy, each role's calls trained with the final answer's reward.

Every call is recorded with the engine's own token ids, so the trainer's logprobs of them match
the engine's at the fp32 floor on every step (token-exact). Both runs are kept short (a few
minutes each, vLLM start included): short prompts, few episodes, few tokens per call.

Both are `long` (make test-long): ~3 min each even at 2 steps, most of it SmolLM2's vLLM start.
make test keeps the same paths on the tiny model: an openai-SDK agent, token-exact
(tests/e2e/test_agent_run.py), two roles with one excluded and merged trajectories under ppo (same
file), the agent in the trainer pod (tests/e2e/test_cluster_e2e.py), and `tools=` / `tool_calls`
through the endpoint (tests/integration/test_agent_endpoint.py).
"""

from __future__ import annotations

import collections
import json
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from harness.workloads.local_jobs import read_history
from harness.workloads.pretrained import smollm2
from lorarl.api import LoRARLJob
from lorarl.data_tasks import write_task_jsonl
from lorarl.local import LocalRun

pytestmark = [pytest.mark.slow, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]


def agent_job(
    data: Path, entrypoint: str, *, steps: int, prompts: int, group: int, response_tokens: int,
    prompt_tokens: int, lr: float, temperature: float, max_calls: int,
    trajectory: str = "perCall", samples: int = 4, micro: int = 16,
) -> LoRARLJob:  # fmt: skip
    return LoRARLJob.model_validate({
        "apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob", "metadata": {"name": "agents"},
        "spec": {
            "model": {"path": str(smollm2()), "dtype": "float32"},
            "lora": {"rank": 16, "alpha": 32},
            "algorithm": {"name": "grpo", "groupSize": group},
            "optim": {"lr": lr},
            "data": {"trainFiles": [str(data)], "maxPromptTokens": prompt_tokens,
                     "maxResponseTokens": response_tokens},
            "agent": {"entrypoint": entrypoint, "maxConcurrency": prompts * group,
                      "timeoutSeconds": 300, "maxCalls": max_calls,
                      "trajectory": trajectory},
            "training": {"totalSteps": steps, "promptsPerStep": prompts,
                         "microBatchSize": micro, "checkpointInterval": steps,
                         "samplesInterval": 1, "samplesPerStep": samples},
            "trainer": {"gpusPerReplica": 0, "processesPerReplica": 1},
            "rollout": {"engine": "vllm", "replicas": 1, "gpusPerReplica": 0,
                        "syncMode": "merged", "kvCacheGib": 1,
                        "sampling": {"temperature": temperature}},
        },
    })  # fmt: skip


def train(job: LoRARLJob, run_dir: Path, engine_python: str) -> list[dict[str, Any]]:
    """Run the job to the end; its history, printed one line a step."""
    t0 = time.monotonic()
    with LocalRun(job, run_dir, engine_python=engine_python) as run:
        run.start()
        result = run.wait(timeout_s=900)
    print(f"\nwall {time.monotonic() - t0:.0f} s")
    assert result.progress is not None and result.progress.phase == "Succeeded", result
    history = read_history(run_dir)
    for h in history:
        metrics = " ".join(f"{k} {v:.2f}" for k, v in (h.get("rewardMetrics") or {}).items())
        print(
            f"step {h['step']}: reward {h['rewardMean']:.3f} {metrics} turns {h['turnsMean']:.2f} "
            f"failed {h['failedEpisodes']} mismatch {h['logprobMismatch']:.1e} "
            f"step {h['stepSeconds']:.0f} s (gen {h['generateSeconds']:.0f} train "
            f"{h['trainSeconds']:.0f})"
        )
    assert [h["step"] for h in history] == list(range(1, job.spec.training.total_steps + 1))
    # Token-exact: the trainer's logprobs of the recorded ids are the engine's (fp32: ~5e-6).
    assert max(h["logprobMismatch"] for h in history) < 1e-4
    return history


def rising(history: list[dict[str, Any]], by: float) -> None:
    rewards = [h["rewardMean"] for h in history]
    assert statistics.mean(rewards[-3:]) > statistics.mean(rewards[:3]) + by, rewards


PLANNER_STEPS = 8


def test_a_planner_and_its_sub_agent_train_together(tmp_path: Path, engine_python: str):
    data = write_task_jsonl(tmp_path / "larger.jsonl", "larger", n=64, seed=0)
    job = agent_job(
        data, f"{ROOT}/examples/agents/planner_agent.py:run", steps=PLANNER_STEPS, prompts=4,
        group=8, response_tokens=24, prompt_tokens=128, lr=6e-4, temperature=0.7, max_calls=2,
        samples=64,
    )  # fmt: skip
    history = train(job, tmp_path / "run", engine_python)
    assert max(h["failedEpisodes"] for h in history) <= 2  # (a timeout on a loaded machine)
    assert all(h["turnsMean"] == 2.0 for h in history)
    assert all(set(h["rewardMetrics"]) == {"planner_passed_numbers"} for h in history)
    rising(history, 0.05)
    # Both roles' calls were trained: the samples log (every sample of every step) holds as
    # many solver prompts as planner prompts.
    rows = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    roles = collections.Counter(
        (r["step"], "planner" if "You are a planner" in r["prompt"] else "solver") for r in rows
    )
    assert all(roles[s, "planner"] == roles[s, "solver"] == 32 for s in range(1, PLANNER_STEPS + 1))


CALCULATOR_STEPS = 6


def test_a_tool_calling_agent_learns_to_use_its_calculator(tmp_path: Path, engine_python: str):
    # 3-digit products after two worked calculator calls (SmolLM2 calls tools only after seeing
    # some; unaided it gets none right), as the tool-calling example trains them.
    data = write_task_jsonl(tmp_path / "multiply.jsonl", "multiply-tools", n=64, seed=1)
    job = agent_job(
        data, f"{ROOT}/examples/agents/calculator_agent.py:run", steps=CALCULATOR_STEPS,
        prompts=2, group=8, response_tokens=40, prompt_tokens=512, lr=3e-4, temperature=1.0,
        max_calls=4, trajectory="merged", micro=4, samples=16,  # micro 4: ~400-token episodes
    )  # fmt: skip
    history = train(job, tmp_path / "run", engine_python)
    assert max(h["failedEpisodes"] for h in history) <= 2  # (a timeout on a loaded machine)
    assert all(set(h["rewardMetrics"]) == {"tool_rounds"} for h in history)
    rising(history, 0.1)
    rounds = [h["rewardMetrics"]["tool_rounds"] for h in history]  # the agent's own metric
    assert statistics.mean(rounds[-3:]) > statistics.mean(rounds[:3]), rounds
    # The calls of an episode were merged into one sample (the check that each call's prompt
    # extends the last call's prompt + reply, token for token, held): the tool's result sits
    # inside a trained completion, masked, and the mismatch above stayed at the floor.
    rows = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert any("<tool_response>" in r["completion"] for r in rows)
