"""spec.logging: tracker credentials reach the trainer container, and only it, by Secret reference;
the tracker run is named as the user says; sample completions are picked, cut and trimmed as
documented."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from lorarl.api.reports.samples import (
    SAMPLES_FILE,
    append_samples,
    read_sample_rows,
    read_samples,
    trim_samples,
)
from lorarl.api.spec.tracking import WandbSettings
from lorarl.api.validation import check_manifest, parse_job
from lorarl.local.tiny import make_tokenizer
from lorarl.operator import builders
from lorarl.plan import plan
from lorarl.trainer.rl.samples import TrainSample
from lorarl.trainer.telemetry.samples import TEXT_LIMIT, due, sample_rows
from lorarl.trainer.telemetry.sinks import MlflowSink, WandbSink, run_name
from lorarl.trainer.telemetry.tracking import RunIds, flatten

ROOT = Path(__file__).resolve().parents[4]
QUICKSTART = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
WANDB_REF = {"name": "wandb", "key": "api-key"}


def _doc(**spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(QUICKSTART)
    doc["spec"].update(spec)
    return doc


def _envs(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    j = parse_job(doc)
    p = plan(j)
    out = {}
    for role in p.roles:
        for r in role.replicas:
            for c in builders.pod(p, j, role.role, r.index)["spec"]["containers"]:
                out[f"{role.role}-{r.index}/{c['name']}"] = c["env"]
    return out


def test_credentials_reach_the_trainer_container_only_as_secret_refs():
    doc = _doc(
        logging={
            "backends": ["mlflow", "wandb"],
            "mlflow": {
                "trackingUri": "http://mlflow.mlops:5000",
                "tokenSecret": {"name": "mlflow", "key": "token"},
            },
            "wandb": {"apiKeySecret": WANDB_REF},
        }
    )
    envs = _envs(doc)
    trainer = {e["name"]: e for e in envs.pop("trainer-0/trainer")}
    assert trainer["WANDB_API_KEY"] == {
        "name": "WANDB_API_KEY",
        "valueFrom": {"secretKeyRef": WANDB_REF},
    }
    assert trainer["MLFLOW_TRACKING_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "mlflow", "key": "token"}
    }
    assert envs, "the job has other containers"
    for name, env in envs.items():  # engines, sidecars: no tracker key
        assert not {e["name"] for e in env} & {"WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN"}, name


@pytest.mark.parametrize(
    ("logging", "trainer_env", "message"),
    [
        ({"backends": ["mlflow"]}, [], "the mlflow backend needs mlflow.trackingUri"),
        (
            {"backends": ["wandb"], "wandb": {"mode": "online"}},
            [],
            "wandb online needs an API key",
        ),
        (
            {"backends": ["wandb"]},
            [{"name": "WANDB_API_KEY", "value": "abc"}],
            "must come from a Secret",
        ),
        (
            {"backends": ["mlflow"], "mlflow": {"trackingUri": "ftp://x"}},
            [],
            "spec.logging.mlflow.trackingUri",
        ),
        ({"backends": ["neptune"]}, [], "spec.logging.backends[0]: must be one of"),
    ],
)
def test_bad_logging_is_refused_naming_the_field(logging, trainer_env, message):
    doc = _doc(logging=logging)
    doc["spec"]["trainer"] = {**doc["spec"].get("trainer", {}), "env": trainer_env}
    problems = [str(p) for p in check_manifest(doc)]
    assert any(message in p for p in problems), problems


def test_an_online_key_from_trainer_env_is_accepted():
    doc = _doc(logging={"backends": ["wandb"], "wandb": {"mode": "online"}})
    doc["spec"]["trainer"] = {
        **doc["spec"].get("trainer", {}),
        "env": [{"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": WANDB_REF}}],
    }
    assert check_manifest(doc) == []


def test_the_tracker_run_name_is_logging_run_name_else_the_job_name():
    named = parse_job(_doc(logging={"backends": ["wandb"], "runName": "qwen2.5_3b grpo/v2"}))
    assert run_name(named) == "qwen2.5_3b grpo/v2"
    unnamed = parse_job(_doc(logging={"backends": ["wandb"]}))
    assert run_name(unnamed) == unnamed.name == QUICKSTART["metadata"]["name"]
    problems = [str(p) for p in check_manifest(_doc(logging={"runName": ""}))]
    assert any("spec.logging.runName" in p for p in problems), problems
    mlflow = {"backends": ["mlflow"], "runName": "x", "mlflow": {"trackingUri": "file:///m"}}
    assert check_manifest(_doc(logging=mlflow)) == []


def test_wandb_and_mlflow_runs_are_opened_with_the_run_name(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    job = parse_job(_doc(logging={"backends": ["wandb", "mlflow"], "runName": "my run",
                                  "mlflow": {"trackingUri": "file:///tmp/m"}}))  # fmt: skip
    wandb = WandbSink(WandbSettings(), job, tmp_path, RunIds(tmp_path))
    inits: list[dict[str, Any]] = []
    wandb._wandb = SimpleNamespace(init=lambda **kw: inits.append(kw), Settings=dict)
    wandb.open()
    assert inits[0]["name"] == "my run" and inits[0]["project"] == job.name

    runs: list[dict[str, Any]] = []

    class Client:
        def __init__(self, tracking_uri: str):
            pass

        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name):
            return "1"

        def create_run(self, exp_id, run_name, tags):
            runs.append({"run_name": run_name, "tags": tags})
            return SimpleNamespace(info=SimpleNamespace(run_id="r1"))

        def log_dict(self, *args):
            pass

    assert job.spec.logging.mlflow is not None
    mlflow = MlflowSink(job.spec.logging.mlflow, job, RunIds(tmp_path))
    mlflow._mlflow = SimpleNamespace(MlflowClient=Client)
    mlflow.open()
    assert runs == [{"run_name": "my run", "tags": {"lorarl.job": job.name}}]


def test_flatten_keeps_numbers_nests_with_slashes_and_drops_the_axes():
    record = {
        "step": 3,
        "time": 1.0,
        "rewardMean": 0.5,
        "kl": None,
        "phase": "x",
        "flag": True,
        "eval": {"step": 3, "accuracy": 0.25, "passAtK": {"1": 0.25, "2": 0.5},
                 "by_source": {"openai/gsm8k": {"accuracy": 0.5, "prompts": 2}}},
    }  # fmt: skip
    assert flatten(record) == {
        "rewardMean": 0.5,
        "eval/accuracy": 0.25,
        "eval/passAtK/1": 0.25,
        "eval/passAtK/2": 0.5,
        "eval/by_source/openai/gsm8k/accuracy": 0.5,
        "eval/by_source/openai/gsm8k/prompts": 2.0,
    }


def _samples(n: int, tok) -> list[TrainSample]:
    out = []
    for i in range(n):
        prompt = tok.encode(f"prompt {i}", add_special_tokens=False)
        completion = tok.encode("x" * (TEXT_LIMIT + 10) if i == 0 else f"answer {i}",
                                add_special_tokens=False)  # fmt: skip
        out.append(TrainSample(prompt, completion, [0.0] * len(completion), i - 1.5, float(i), 0,
                               finish_reason="length" if i == 0 else "stop"))  # fmt: skip
    return out


def test_sample_rows_spread_over_the_batch_and_are_cut(tmp_path: Path):
    tok = make_tokenizer()
    rows = sample_rows(7, _samples(8, tok), tok, 4)
    assert [r["reward"] for r in rows] == [0.0, 2.0, 4.0, 6.0]  # one per pair of samples
    assert [r["advantage"] for r in rows] == [-1.5, 0.5, 2.5, 4.5]
    assert {r["step"] for r in rows} == {7}
    assert rows[0]["finish_reason"] == "length" and rows[1]["finish_reason"] == "stop"
    assert "prompt" in rows[1]["prompt"] and "answer" in rows[1]["completion"]
    assert len(rows[0]["completion"]) < TEXT_LIMIT + 60
    assert rows[0]["completion"].endswith("more characters]")
    assert sample_rows(1, _samples(2, tok), tok, 4) == sample_rows(1, _samples(2, tok), tok, 2)


def test_samples_file_appends_and_a_resume_drops_the_redone_steps(tmp_path: Path):
    tok = make_tokenizer()
    for step in (2, 4, 6):
        append_samples(tmp_path, sample_rows(step, _samples(4, tok), tok, 2))
    with open(tmp_path / SAMPLES_FILE, "a") as f:
        f.write('{"step": 8, "prom')  # a torn last line
    assert [r["step"] for r in read_sample_rows(tmp_path)] == [2, 2, 4, 4, 6, 6]
    assert [r.step for r in read_samples(tmp_path, limit=3)] == [4, 6, 6]  # the newest
    trim_samples(tmp_path, 4)
    lines = (tmp_path / SAMPLES_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 2, 4, 4]


def test_samples_are_due_every_interval_and_never_when_off():
    job = parse_job(_doc(training={**QUICKSTART["spec"]["training"], "samplesInterval": 3}))
    assert [s for s in range(1, 10) if due(s, job.spec.training)] == [3, 6, 9]
    off = parse_job(_doc()).spec.training
    assert not any(due(s, off) for s in range(1, 10))
