"""Bad input stops the trainer with one clear line naming the problem, not a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from harness.workloads.local_jobs import letter_job

ROOT = Path(__file__).resolve().parents[2]


def run_trainer(tmp_path: Path, job) -> subprocess.CompletedProcess:
    config = tmp_path / "job.yaml"
    # Never the default /workspace/output: a trainer that gets further than the test expects
    # must not write on the host.
    job.spec.training.output_dir = str(tmp_path / "out")
    config.write_text(yaml.safe_dump(job.model_dump(mode="json", by_alias=True, exclude_none=True)))
    env = {
        **os.environ,
        "LORARL_ROLLOUT_ENDPOINTS": "http://127.0.0.1:9",
        "LORARL_LOG_LEVEL": "ERROR",
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "lorarl.trainer", "--config", str(config)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def assert_one_clear_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("lorarl-trainer: error: "), result.stderr
    for fragment in fragments:
        assert fragment in last, last


def test_missing_model_path(tmp_path: Path):
    job = letter_job(tmp_path)
    job.spec.model.path = str(tmp_path / "no-such-model")
    assert_one_clear_line(run_trainer(tmp_path, job), "no-such-model", "does not exist")


def test_adapter_rank_disagrees_with_spec(tmp_path: Path):
    job = letter_job(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(job.spec.model.path)
    get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    ).save_pretrained(tmp_path / "adapter-r4")
    job.spec.lora.adapter_path = str(tmp_path / "adapter-r4")
    assert_one_clear_line(run_trainer(tmp_path, job), "spec.lora.rank: 8", "says r=4")


def test_empty_dataset(tmp_path: Path):
    job = letter_job(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    job.spec.data.train_files = [str(tmp_path / "empty.jsonl")]
    assert_one_clear_line(run_trainer(tmp_path, job), "empty.jsonl")


@pytest.mark.parametrize("key", ["question"])
def test_missing_prompt_key(tmp_path: Path, key: str):
    job = letter_job(tmp_path)
    job.spec.data.prompt_key = key
    result = run_trainer(tmp_path, job)
    assert_one_clear_line(result, key, "letters.jsonl")


def test_unknown_reward_params(tmp_path: Path):
    job = letter_job(tmp_path)
    job.spec.reward.params = {"no_such_param": 1}
    assert_one_clear_line(run_trainer(tmp_path, job), "spec.reward", "no_such_param")


def test_a_critic_adapter_that_fits_no_module_is_refused_up_front(tmp_path: Path):
    job = letter_job(tmp_path, algorithm={"name": "ppo", "groupSize": 2},
                     critic={"lora": {"targetModules": ["no_such_proj"]}})  # fmt: skip
    assert_one_clear_line(run_trainer(tmp_path, job), "critic.lora", "no_such_proj")


def test_config_file_itself_is_validated(tmp_path: Path):
    (tmp_path / "job.yaml").write_text(json.dumps({"kind": "LoRARLJob", "spec": {}}))
    env = {**os.environ, "LORARL_LOG_LEVEL": "ERROR"}
    result = subprocess.run(
        [sys.executable, "-m", "lorarl.trainer", "--config", str(tmp_path / "job.yaml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert_one_clear_line(result, "spec.model: required field is missing")
