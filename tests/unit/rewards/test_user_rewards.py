"""Rewards as users have them (issue 37 #2): a reward from a `.py` file, verl's `compute_score`
signature called by keyword, dict returns (score + metrics into the step record), the import
checked by `lorarl validate --deep`, and the ConfigMap that carries the file into the pods."""

from __future__ import annotations

import copy
import math
import textwrap
from functools import partial
from pathlib import Path

import kubernetes_validate
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from harness.workloads.tiny_models import make_tokenizer
from lorarl.api.resource import LoRARLJob
from lorarl.api.rules import CLUSTER
from lorarl.api.validation import check_manifest, parse_job
from lorarl.cli.main import main
from lorarl.local.preflight import missing_inputs
from lorarl.operator import builders
from lorarl.plan import plan
from lorarl.rewards import RewardError, RewardResult, get_reward, score_batch
from lorarl.rewards.registry import to_result
from lorarl.trainer.data.prompts import DataPosition, PromptDataset, PromptSampler
from lorarl.trainer.generation.rollouts import RolloutWorker
from lorarl.trainer.generation.types import Sample, SamplingParams
from lorarl.trainer.telemetry.step_record import step_record
from lorarl.trainer.telemetry.tracking import flatten

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE_FILE = ROOT / "examples" / "rewards" / "gsm8k_verl.py"
EXAMPLE_JOB = ROOT / "examples" / "gsm8k-verl-reward.yaml"


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def verl_row(i: int, truth: str, **extra) -> dict:
    """A row of verl's preprocessed GSM8K parquet."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"question {i}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": i, **extra},
    }


# ---------------------------------------------------------------- files


def test_a_reward_file_is_imported_by_path_and_can_import_its_neighbours(tmp_path, monkeypatch):
    write(tmp_path / "code" / "helpers.py", "def norm(s):\n    return s.strip().lower()\n")
    write(
        tmp_path / "code" / "my_reward.py",
        """
        from helpers import norm

        def score(prompt, completion, ground_truth, metadata, *, bonus=0.0):
            return float(norm(completion) == norm(ground_truth)) + bonus
        """,
    )
    absolute = get_reward(f"{tmp_path}/code/my_reward.py:score", bonus=0.5)
    assert absolute.name == f"{tmp_path}/code/my_reward.py:score"
    assert absolute("p", " Paris ", "paris", {}) == 1.5
    monkeypatch.chdir(tmp_path)  # relative paths are relative to the working directory
    assert get_reward("code/my_reward.py:score")("p", "Rome", "paris", {}) == 0.0


@pytest.mark.parametrize(
    ("source", "spec_suffix", "message"),
    [
        (None, ":score", r"no file .*/missing\.py"),
        ("def score(:\n", ":score", r"importing .* failed: SyntaxError: .* \(line 1\)$"),
        ("x = 1\nraise_here = undefined_name\n", ":score",
         r"failed: NameError: name 'undefined_name' is not defined \(line 2\)$"),
        ("import no_such_dependency_xyz\n", ":score",
         r"ModuleNotFoundError: No module named 'no_such_dependency_xyz' \(line 1\)$"),
        ("def other(p, c, t, m):\n    return 1.0\n", ":score", r"has no attribute 'score'$"),
        ("score = 3\n", ":score", r"'score' is a int, not callable$"),
    ],
)  # fmt: skip
def test_a_broken_reward_file_is_one_line_naming_the_reward(tmp_path, source, spec_suffix, message):
    path = tmp_path / ("missing.py" if source is None else "broken.py")
    if source is not None:
        path.write_text(source)
    spec = f"{path}{spec_suffix}"
    with pytest.raises(ValueError, match=message) as err:
        get_reward(spec)
    assert str(err.value).startswith(f"reward {spec!r}: ") and "\n" not in str(err.value)


# ---------------------------------------------------------------- verl's signature


def test_verl_compute_score_gets_the_rows_fields_by_keyword(tmp_path):
    """Bound positionally (the old behaviour), verl's function took the prompt as data_source
    and scored the prompt: no error, wrong rewards."""
    write(
        tmp_path / "verl_reward.py",
        """
        SEEN = []

        def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
            SEEN.append((data_source, solution_str, ground_truth, extra_info))
            return scale * float(ground_truth in solution_str)
        """,
    )
    reward = get_reward(f"{tmp_path}/verl_reward.py:compute_score", scale=2.0)
    row = verl_row(3, "42", answer="... #### 42")
    metadata = {k: v for k, v in row.items() if k != "prompt"}
    assert reward("question 3", "so #### 42", "42", metadata) == 2.0
    assert reward("the prompt says 42", "no idea", "42", metadata) == 0.0
    seen = reward.fn.fn.__globals__["SEEN"]
    assert seen[0] == (
        "openai/gsm8k",
        "so #### 42",
        "42",
        {"split": "train", "index": 3, "answer": "... #### 42"},
    )
    # Without an extra_info column (plain jsonl), extra_info is the row's other fields.
    reward("p", "42", "42", {"data_source": "mine", "level": 2})
    assert seen[-1] == ("mine", "42", "42", {"data_source": "mine", "level": 2})
    reward("p", "42", "42", {})  # no data_source column: None, as verl would pass a missing key
    assert seen[-1][0] is None


def test_verl_style_is_recognised_by_its_names_and_checked_at_bind_time():
    got = {}

    def kwargs_only(solution_str, ground_truth, **kwargs):  # verl passes all four by keyword
        got.update(kwargs, solution_str=solution_str)
        return 1.0

    get_reward(kwargs_only)("p", "c", "t", {"data_source": "d", "extra_info": {"k": 1}})
    assert got == {"solution_str": "c", "data_source": "d", "extra_info": {"k": 1}}

    def three(data_source, solution_str, ground_truth):
        return float(data_source == "d" and solution_str == "c" and ground_truth == "t")

    assert get_reward(three)("p", "c", "t", {"data_source": "d"}) == 1.0

    def renamed(data_source, response, ground_truth, extra_info=None):
        return 0.0

    with pytest.raises(ValueError, match=r"'renamed': a verl-style .* must take solution_str"):
        get_reward(renamed)

    def strict(data_source, solution_str, ground_truth, extra_info, *, method="strict"):
        return 0.0

    with pytest.raises(ValueError, match=r"verl-style .* params \['methd'\]: .*'methd'"):
        get_reward(strict, methd="flexible")
    get_reward(strict, method="flexible")  # its own keyword is fine

    async def verl_async(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth}

    assert to_result(get_reward(verl_async)("p", "c", "c", {})).metrics == {"acc": 1.0}

    def lorarl_style(prompt, completion, ground_truth, metadata):
        return float(prompt == "p" and completion == "c")

    assert get_reward(lorarl_style)("p", "c", None, {}) == 1.0  # unchanged


# ---------------------------------------------------------------- dict returns


def test_a_dict_return_is_the_score_plus_metrics():
    value = {"score": 1, "acc": True, "n": np.float32(2.0), "hit": np.bool_(False),
             "pred": "42", "ratio": math.nan}  # fmt: skip
    result = to_result(value, "mine")
    assert result.score == 1.0 and type(result.score) is float
    assert result.metrics == {"acc": 1.0, "n": 2.0, "hit": 0.0}
    assert result.info["pred"] == "42" and math.isnan(result.info["ratio"])  # kept, not averaged
    # A RewardResult may carry metrics too (lorarl's own signature).
    assert to_result(RewardResult(0.5, {"metrics": {"len": 3}})).metrics == {"len": 3}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"acc": 1.0}, r"'f.py:score' returned a dict without a 'score' key \(keys: acc\)"),
        ({"score": math.inf, "acc": 1}, r"'f.py:score' returned a non-finite score inf"),
        ({"score": math.nan}, r"'f.py:score' returned a non-finite score nan"),
        ({"score": "1.0"}, r"'f.py:score' returned score '1.0' \(str\); expected a number"),
        ({"score": 1.0, "metrics": {"a": 1}}, r"'metrics' key, which lorarl reserves"),
        (RewardResult(1.0, {"metrics": {"a": math.inf}}), r"must map names to finite numbers"),
    ],
)
def test_a_bad_dict_return_is_an_error_naming_the_function(value, message):
    with pytest.raises(RewardError, match=message):
        to_result(value, "f.py:score")


def test_score_batch_takes_dict_returns_and_weighted_keeps_component_metrics():
    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth}

    results = score_batch(get_reward(verl), ["p", "p"], ["4", "5"], ["4", "4"], [{}, {}])
    assert [(r.score, dict(r.metrics)) for r in results] == [
        (1.0, {"acc": 1.0}),
        (0.0, {"acc": 0.0}),
    ]
    combined = get_reward("weighted", components=[(verl, 0.5), ("exact_match", 1.0)])
    result = to_result(combined("p", "4", "4", {}))
    assert result.score == 1.5 and result.metrics == {"verl/acc": 1.0}


# ---------------------------------------------------------------- the trainer's reward path


class TextClient:
    """Each prompt's group: the completions scripted for it, as the tiny tokenizer's ids."""

    def __init__(self, tokenizer, texts: list[list[str]]):
        self.tokenizer, self.texts = tokenizer, texts

    def generate(self, prompts, n, params, *, model=None, expected_version=0):
        out = []
        for p, texts in zip(prompts, self.texts, strict=True):
            group = []
            for text in texts:
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                group.append(Sample(list(p), ids, [-1.0] * len(ids), "stop", 0, "http://e"))
            out.append(group)
        return out


def test_the_example_reward_file_scores_a_step_and_its_metrics_reach_the_step_record():
    """The trainer's own wiring (loop.build_scorer) on the example file, through the rollout
    worker's decode and scoring, to the step record, its wire form and the trackers' names."""
    from lorarl.trainer.loop import build_scorer

    doc = yaml.safe_load(EXAMPLE_JOB.read_text())
    doc["spec"]["reward"] = {"entrypoint": f"{EXAMPLE_FILE}:compute_score"}
    job = LoRARLJob.model_validate(doc)
    scorer, _ = build_scorer(job, None)
    rows = [verl_row(0, "72"), verl_row(1, "1000")]
    tokenizer = make_tokenizer()
    worker = RolloutWorker(
        dataset=PromptDataset.from_rows(rows, "prompt", "reward_model.ground_truth"),
        sampler=PromptSampler(2, 2, seed=0, shuffle=False), tokenizer=tokenizer,
        client=TextClient(tokenizer, [["so #### 72", "about 72"], ["#### 1,000", "#### 999"]]),
        scorer=scorer, estimator="grpo", group_size=2, max_prompt_tokens=64,
        sampling=SamplingParams(max_tokens=16),
    )  # fmt: skip
    collected = worker.collect(DataPosition(), 0, "base")
    assert collected.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]  # strict: "about 72" has no ####
    assert collected.reward_metrics == {"acc": 0.5, "formatted": 0.75}  # `pred` is text
    numbers = {"trained_tokens": 0, "clip_frac_first_update": 0.0, "grad_norm": 0.0}
    numbers |= {f"logprob_mismatch{s}": 0.0 for s in ("", "_p50", "_p90", "_p99")}
    record = step_record(1, collected, numbers, train_s=0.0, sync=None, t_start=0.0, lr=1e-5)
    assert record.reward_metrics == {"acc": 0.5, "formatted": 0.75}
    assert record.wire()["rewardMetrics"] == {"acc": 0.5, "formatted": 0.75}
    tracked = flatten(record.model_dump(mode="json"))
    assert tracked["reward_metrics/acc"] == 0.5 and tracked["reward_metrics/formatted"] == 0.75


def test_a_reward_without_metrics_leaves_the_record_field_unset():
    tokenizer = make_tokenizer()
    worker = RolloutWorker(
        dataset=PromptDataset.from_rows([{"prompt": "a", "answer": "x"}], "prompt", "answer"),
        sampler=PromptSampler(1, 1, seed=0, shuffle=False), tokenizer=tokenizer,
        client=TextClient(tokenizer, [["x", "y"]]),
        scorer=partial(score_batch, get_reward("exact_match")), estimator="grpo", group_size=2,
        max_prompt_tokens=64, sampling=SamplingParams(max_tokens=4),
    )  # fmt: skip
    assert worker.collect(DataPosition(), 0, "base").reward_metrics is None


# ---------------------------------------------------------------- validate --deep, preflight


def local_job(tmp_path: Path, entrypoint: str, params: dict | None = None) -> Path:
    doc = {
        "apiVersion": "lorarl.dev/v1alpha1",
        "kind": "LoRARLJob",
        "metadata": {"name": "mine"},
        "spec": {
            "model": {"path": "./model"},
            "data": {"trainFiles": ["train.jsonl"]},
            "reward": {"entrypoint": entrypoint, "params": params or {}},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_validate_deep_imports_the_reward_and_reports_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "bad.py", "def compute_score(data_source, solution_str, ground_truth):\n"
                               "    return 1.0\nundefined_call()\n")  # fmt: skip
    job = local_job(tmp_path, "bad.py:compute_score")
    assert CliRunner().invoke(main, ["validate", "--local", str(job)]).exit_code == 0  # form only
    r = CliRunner().invoke(main, ["validate", "--local", "--deep", str(job)])
    assert r.exit_code == 1
    assert r.output.strip() == (
        f"{job}: spec.reward.entrypoint: reward 'bad.py:compute_score': importing bad.py failed: "
        "NameError: name 'undefined_call' is not defined (line 3)"
    )
    job = local_job(tmp_path, f"{EXAMPLE_FILE}:compute_score", {"methd": "flexible"})
    r = CliRunner().invoke(main, ["validate", "--local", "--deep", str(job)])
    assert r.exit_code == 1 and "verl-style reward" in r.output and "'methd'" in r.output
    job = local_job(tmp_path, f"{EXAMPLE_FILE}:compute_score", {"method": "flexible"})
    r = CliRunner().invoke(main, ["validate", "--local", "--deep", str(job)])
    assert r.exit_code == 0 and ": ok (mine)" in r.output
    job = local_job(tmp_path, "missing.py:compute_score")
    r = CliRunner().invoke(main, ["validate", "--local", "--deep", str(job)])
    assert r.exit_code == 1 and "spec.reward.entrypoint: no file missing.py" in r.output


def test_validate_deep_skips_code_only_the_cluster_has():
    """The example's file is in its ConfigMap, not at /rewards here: nothing to import."""
    r = CliRunner().invoke(main, ["validate", "--deep", str(EXAMPLE_JOB)])
    assert r.exit_code == 0, r.output


def test_a_local_run_names_a_missing_reward_file_before_starting(tmp_path):
    job = parse_job(yaml.safe_load(local_job(tmp_path, "nope/reward.py:f").read_text()))
    assert "spec.reward.entrypoint: nope/reward.py is not a file here" in missing_inputs(job)


# ---------------------------------------------------------------- the spec and the pods


def reward_job(reward: dict, **spec) -> dict:
    doc = copy.deepcopy(yaml.safe_load(EXAMPLE_JOB.read_text()))
    doc["metadata"]["namespace"] = "team"
    doc["spec"]["reward"] = reward
    doc["spec"].update(spec)
    return doc


CM = {"name": "gsm8k-reward", "mountPath": "/rewards"}


@pytest.mark.parametrize(
    ("reward", "spec", "problem"),
    [
        ({"entrypoint": "/rewards/r.py:compute_score", "configMap": CM}, {}, None),
        ({"entrypoint": "/other/r.py:compute_score", "configMap": CM}, {},
         "spec.reward.entrypoint: configMap holds the reward's code"),
        ({"entrypoint": "/rewardsx/r.py:f", "configMap": CM}, {}, "configMap holds"),
        ({"entrypoint": "rewards/r.py:f"}, {}, "a reward file in a cluster is an absolute path"),
        ({"entrypoint": "/data/r.py:f", "service": {}}, {},
         "serves your code only as a file in reward.configMap"),
        ({"entrypoint": "/rewards/r.py:f", "configMap": CM, "service": {}}, {}, None),
        ({"entrypoint": "/rewards/r.py:f", "configMap": CM, "service": {"url": "http://r:1"}}, {},
         "spec.reward.configMap: an external reward service"),
        ({"entrypoint": "/data/r.py:f", "configMap": {"name": "r", "mountPath": "/data"}}, {},
         "rollout.cacheVolume need distinct mountPaths"),
        ({"entrypoint": "/tmp/r.py:f", "configMap": {"name": "r", "mountPath": "/tmp"}}, {},
         "rollout.cacheVolume need distinct mountPaths"),
        ({"entrypoint": "not a path.txt:f"}, {}, "spec.reward.entrypoint: must match the pattern"),
    ],
)  # fmt: skip
def test_reward_file_rules(reward, spec, problem):
    problems = [str(p) for p in check_manifest(reward_job(reward, **spec))]
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


def test_a_relative_reward_file_is_fine_for_a_local_run():
    doc = reward_job({"entrypoint": "rewards/r.py:f"})
    assert check_manifest(doc, cluster=False) == []
    with pytest.raises(ValueError, match="absolute path"):
        LoRARLJob.model_validate(doc, context=CLUSTER)


@pytest.mark.parametrize("version", ["1.34"])
def test_the_config_map_is_mounted_read_only_where_the_reward_runs(version):
    j = parse_job(reward_job({"entrypoint": "/rewards/r.py:f", "configMap": CM, "service": {}}))
    p = plan(j)
    volume = {"name": "reward-code", "configMap": {"name": "gsm8k-reward"}}
    mount = {"name": "reward-code", "mountPath": "/rewards", "readOnly": True}
    for role in ("trainer", "reward", "rollout"):
        pod = builders.pod(p, j, role, 0)
        kubernetes_validate.validate(pod, version, strict=True)
        spec = pod["spec"]
        scores = role != "rollout"  # engines and sidecars never import the reward
        assert (volume in spec["volumes"]) is scores, role
        mounted = [c["name"] for c in spec["containers"] if mount in c["volumeMounts"]]
        assert mounted == ([role] if scores else []), role
    without = parse_job(reward_job({"entrypoint": "/img/r.py:f"}))
    trainer = builders.pod(plan(without), without, "trainer", 0)["spec"]
    assert not [v for v in trainer["volumes"] if v["name"] == "reward-code"]
