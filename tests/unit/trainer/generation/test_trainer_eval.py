"""Evals on data.valFiles: pass@k, the eval record, and where it is reported (issue 14 #1)."""

from __future__ import annotations

import itertools
import json
import logging
import math
from types import SimpleNamespace

import pytest
from rich.console import Console

from harness.workloads.tiny_models import make_tokenizer
from lorarl.api.reports import run_files
from lorarl.api.reports.progress import Progress, StepRecord
from lorarl.api.reports.status import EvalRecord, LoRARLJobStatus
from lorarl.api.validation import parse_job
from lorarl.local.console import LiveView, summary
from lorarl.local.ports import free_port
from lorarl.operator.status import apply_progress
from lorarl.server.views import status_from_progress
from lorarl.trainer.data.prompts import PromptDataset
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.eval import (
    MAX_SOURCES,
    SAVED_TEXT_LIMIT,
    Evaluator,
    aggregate,
    eval_file,
    generation_rows,
    ks_for,
    pass_at_k,
    read_generations,
    shared_prompts,
    source_key,
    source_metrics,
    write_generations,
)
from lorarl.trainer.generation.types import Sample, SamplingParams
from lorarl.trainer.loop import StepState, Trainer
from lorarl.trainer.settings import Endpoints
from lorarl.trainer.telemetry.progress import ProgressTracker


def by_counting(n: int, c: int, k: int) -> float:
    """pass@k by brute force: the share of k-subsets of the n samples holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(by_counting(n, c, k), abs=1e-12)


def test_pass_at_k_is_stable_for_many_samples() -> None:
    exact = 1 - math.comb(1000 - 3, 64) / math.comb(1000, 64)
    assert pass_at_k(1000, 3, 64) == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_ks_are_powers_of_two_up_to_n() -> None:
    assert ks_for(1) == [1]
    assert ks_for(6) == [1, 2, 4]
    assert ks_for(8) == [1, 2, 4, 8]


def test_aggregate_counts_correct_samples_against_the_threshold() -> None:
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.9]]
    rec = aggregate(rewards, 1.0, step=5, seconds=2.5)
    assert (rec.step, rec.prompts, rec.samples_per_prompt, rec.seconds) == (5, 3, 4, 2.5)
    assert rec.reward_mean == pytest.approx(sum(map(sum, rewards)) / 12)
    assert rec.accuracy == pytest.approx(5 / 12)  # 0.9 is under the threshold
    correct = [2, 0, 3]
    assert list(rec.pass_at_k) == ["1", "2", "4"]
    for k in (1, 2, 4):
        want = sum(by_counting(4, c, k) for c in correct) / 3
        assert rec.pass_at_k[str(k)] == pytest.approx(want)
    assert rec.pass_at_k["1"] == pytest.approx(rec.accuracy)
    assert aggregate(rewards, 0.5, step=5, seconds=0).accuracy == pytest.approx(6 / 12)


def test_aggregate_refuses_ragged_or_empty_groups() -> None:
    with pytest.raises(ValueError, match="every prompt needs 2 samples"):
        aggregate([[1.0, 0.0], [1.0]], 1.0, step=1, seconds=0)
    with pytest.raises(ValueError, match="at least one prompt"):
        aggregate([], 1.0, step=1, seconds=0)


def test_eval_numbers_by_data_source() -> None:
    rewards = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.5, 1.0]]
    sources = ["openai/gsm8k", "math", "openai/gsm8k", None]
    rec = aggregate(rewards, 1.0, step=3, seconds=0, sources=sources)
    got = {k: (v.reward_mean, v.accuracy, v.prompts) for k, v in rec.by_source.items()}
    assert got == {"math": (1.0, 1.0, 1), "openai/gsm8k": (0.25, 0.25, 2),
                   "unknown": (0.75, 0.5, 1)}  # fmt: skip
    assert list(rec.by_source) == sorted(rec.by_source)
    assert rec.line().endswith("; by source: math 1.000, openai/gsm8k 0.250, unknown 0.500")
    # No prompt names a source (or none given): no per-source numbers.
    assert aggregate(rewards, 1.0, step=3, seconds=0, sources=[None] * 4).by_source == {}
    assert aggregate(rewards, 1.0, step=3, seconds=0).by_source == {}
    wire = rec.wire()["bySource"]
    assert wire["openai/gsm8k"] == {"rewardMean": 0.25, "accuracy": 0.25, "prompts": 2}
    with pytest.raises(ValueError, match="4 prompts but 3 data sources"):
        source_metrics(rewards, sources[:3], 1.0)


def test_many_data_sources_keep_the_largest_and_count_the_rest_as_other() -> None:
    sources = ["big"] * 3 + [f"s{i:03d}" for i in range(MAX_SOURCES + 5)]
    out = source_metrics([[1.0]] * len(sources), sources, 1.0)
    assert len(out) == MAX_SOURCES and out["big"].prompts == 3
    assert out["other"].prompts == len(sources) - 3 - (MAX_SOURCES - 2)


@pytest.mark.parametrize(
    ("source", "key"),
    [("openai/gsm8k", "openai/gsm8k"), ("lighteval/MATH-v1.2", "lighteval/MATH-v1.2"),
     ("a b:c?", "a_b_c_"), ("/x//../y/", "x/y"), ("..", "unknown"), (None, "unknown"),
     (7, "7"), ("x" * 300, "x" * 100)],
)  # fmt: skip
def test_source_names_are_metric_names_every_tracker_takes(source, key) -> None:
    assert source_key(source) == key


def prompts(*sources):
    rows = [{"prompt": f"after {i}", "answer": str(i), "data_source": s}
            for i, s in enumerate(sources)]  # fmt: skip
    return list(PromptDataset.from_rows(rows, "prompt", "answer"))


def test_eval_files_hold_whole_prompt_groups_up_to_the_cap(tmp_path) -> None:
    items = prompts("gsm8k", None, "math")
    texts = [["a" * (SAVED_TEXT_LIMIT + 5), "b"], ["c", "d"], ["e", "f"]]
    rows = generation_rows(10, items, texts, [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], limit=4)
    assert [r["index"] for r in rows] == [0, 1]  # the third group would pass the cap
    assert rows[0]["data_source"] == "gsm8k" and rows[1]["data_source"] is None
    assert len(rows[0]["completions"][0]) == SAVED_TEXT_LIMIT
    assert (rows[0]["prompt"], rows[0]["answer"], rows[1]["rewards"]) == ("after 0", "0", [0, 0])
    assert len(generation_rows(1, items, texts, [[0.0] * 2] * 3, limit=1)[0]["completions"]) == 1

    path = eval_file(tmp_path / "evals", 10)
    assert path.name == "step-000010.jsonl"
    write_generations(path, rows)
    write_generations(path, rows[:1])  # a redone eval replaces the file whole
    assert read_generations(path) == rows[:1]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def test_each_eval_saves_its_completions_and_rewards(tmp_path, caplog) -> None:
    tok = make_tokenizer()
    words = iter(["yes", "no", "yes", "yes"])

    def generate(prompt_ids, n, sampling, *, model, expected_version):
        def sample():
            ids = tok.encode(next(words), add_special_tokens=False)
            return Sample([1], ids, [0.0] * len(ids), "stop", expected_version, "e")

        return [[sample() for _ in range(n)] for _ in prompt_ids]

    def scorer(prompts, completions, truths, metas):
        return [SimpleNamespace(score=float(c == "yes")) for c in completions]

    ev = Evaluator(
        dataset=PromptDataset(prompts("gsm8k", "math")), tokenizer=tok,
        client=SimpleNamespace(generate=generate), scorer=scorer, n=2,
        sampling=SamplingParams(max_tokens=4), max_prompt_tokens=32, threshold=1.0,
        save_dir=tmp_path / "evals",
    )  # fmt: skip
    rec = ev.run(step=4, version=4, model_name="m")
    assert rec.accuracy == 0.75 and rec.by_source["gsm8k"].accuracy == 0.5
    rows = read_generations(tmp_path / "evals" / "step-000004.jsonl")
    assert [(r["data_source"], r["completions"], r["rewards"]) for r in rows] == [
        ("gsm8k", ["yes", "no"], [1.0, 0.0]),
        ("math", ["yes", "yes"], [1.0, 1.0]),
    ]
    # A folder it cannot write: the numbers are still reported, with a warning.
    (tmp_path / "file").write_text("")
    ev.save_dir, words = tmp_path / "file" / "evals", iter(["no"] * 4)
    with caplog.at_level(logging.WARNING, logger="lorarl.trainer.generation.eval"):
        assert ev.run(step=5, version=5, model_name="m").accuracy == 0.0
    assert "could not save the eval's completions" in caplog.text


def record(step: int, accuracy: float) -> EvalRecord:
    return EvalRecord(
        step=step, reward_mean=accuracy, accuracy=accuracy, pass_at_k={"1": accuracy},
        prompts=8, samples_per_prompt=1, seconds=0.5,
    )  # fmt: skip


def step(n: int, ev: EvalRecord | None = None) -> StepRecord:
    return StepRecord(step=n, time=1.0, reward_mean=0.1 * n, eval=ev)


def test_tracker_reports_the_baseline_and_each_steps_eval(tmp_path, capsys) -> None:
    tracker = ProgressTracker("job", 4, tmp_path)
    tracker.record_eval(record(0, 0.25))
    assert json.loads(capsys.readouterr().out)["event"] == "eval"
    tracker.record(step(1), None)
    tracker.record(step(2, record(2, 0.5)), None)
    tracker.record(step(3), None)
    progress = run_files.read_progress(tmp_path)
    assert progress.baseline_eval.accuracy == 0.25
    assert (progress.eval.step, progress.eval.accuracy) == (2, 0.5)
    history = run_files.read_history(tmp_path)
    assert [r.eval.step if r.eval else None for r in history] == [None, 2, None]
    wire = json.loads((tmp_path / run_files.PROGRESS_FILE).read_text())
    assert wire["eval"]["passAtK"] == {"1": 0.5} and wire["baselineEval"]["step"] == 0

    restarted = ProgressTracker("job", 4, tmp_path)  # a restart from step 2's checkpoint
    restarted.resume(2)
    progress = run_files.read_progress(tmp_path)
    assert progress.baseline_eval.accuracy == 0.25 and progress.eval.step == 2
    restarted = ProgressTracker("job", 4, tmp_path)
    restarted.resume(1)  # the step-2 eval is redone later: the baseline is the latest again
    progress = run_files.read_progress(tmp_path)
    assert progress.eval.step == 0


def finished_progress() -> Progress:
    return Progress(
        job="job", phase="Succeeded", step=4, total_steps=4, latest=step(4, record(4, 0.75)),
        eval=record(4, 0.75), baseline_eval=record(0, 0.25),
    )  # fmt: skip


def test_the_operator_puts_the_latest_eval_in_status_eval() -> None:
    status = apply_progress(LoRARLJobStatus(), finished_progress())
    assert (status.eval.step, status.eval.accuracy) == (4, 0.75)
    assert status.baseline_eval.accuracy == 0.25
    assert status.wire()["eval"]["passAtK"] == {"1": 0.75}
    assert apply_progress(status, Progress(job="job", phase="Running", total_steps=4)).eval


def test_the_rest_status_of_a_local_job_has_its_evals() -> None:
    status = status_from_progress(finished_progress())
    assert status.eval.accuracy == 0.75 and status.baseline_eval.step == 0


def test_console_prints_each_new_eval_once_and_the_final_one_in_the_summary() -> None:
    console = Console(record=True, width=120)
    view = LiveView(console, "job", 4)
    running = Progress(job="job", phase="Running", step=0, total_steps=4, eval=record(0, 0.25))
    view.update(running)
    view.update(running)
    view.update(finished_progress())
    text = console.export_text()
    assert text.count("eval before training: accuracy 0.250") == 1
    assert text.count("eval step 4: accuracy 0.750") == 1

    console = Console(record=True, width=120)
    history = [step(1), step(2, record(2, 0.5)), step(3), step(4, record(4, 0.75))]
    summary(console, history, finished_progress())
    text = console.export_text()
    assert "eval accuracy" in text and "0.250 → 0.750" in text
    assert "eval before training: accuracy 0.250" in text
    assert "final eval step 4: accuracy 0.750, reward 0.750, pass@1 0.750" in text

    console = Console(record=True, width=120)  # 40 steps: every 4th in the table, and the evals
    history = [step(n, record(n, 0.01 * n) if n % 10 == 0 else None) for n in range(1, 41)]
    summary(console, history, None)
    rows = [line.split("│") for line in console.export_text().splitlines() if "│" in line]
    shown = {int(r[1]): r[6].strip() for r in rows}
    assert set(shown) == {*range(1, 41, 4), 10, 20, 30, 40}
    assert [shown[n] for n in (10, 20, 30, 40)] == ["0.100", "0.200", "0.300", "0.400"]
    assert shown[1] == ""

    console = Console(record=True, width=120)
    summary(console, [step(1), step(2)], None)
    assert "eval" not in console.export_text()  # no eval column, no eval lines


def job(**training) -> object:
    return parse_job(
        {
            "apiVersion": "lorarl.dev/v1alpha1",
            "kind": "LoRARLJob",
            "metadata": {"name": "t"},
            "spec": {
                "model": {"path": "/m"},
                "data": {"trainFiles": ["t.jsonl"], "valFiles": ["v.jsonl"]},
                "training": {"totalSteps": 10, **training},
            },
        }
    )


def test_evals_are_due_every_interval_and_after_the_last_step() -> None:
    trainer = Trainer.__new__(Trainer)
    trainer.job = job(evalInterval=4)
    assert [s for s in range(1, 11) if trainer._eval_due(s)] == [4, 8, 10]
    trainer.job = job(evalBeforeTrain=True)
    assert not any(trainer._eval_due(s) for s in range(1, 11))


def test_a_failed_eval_is_a_warning_and_the_run_goes_on(caplog) -> None:
    """The engines are gone: the eval reports nothing, the step is not failed."""
    trainer = Trainer.__new__(Trainer)
    trainer.job = job(evalInterval=1)
    trainer.endpoints = Endpoints(rollout=[f"http://127.0.0.1:{free_port()}"])
    trainer.reward_client, trainer.state = None, StepState(step=3, version=3)
    trainer.fleet = None  # no sidecars: the engines in the env are the engines
    client = RolloutClient(
        trainer.endpoints.rollout, "vllm", model_name="m", max_retries=0, timeout_s=5
    )
    trainer.worker = SimpleNamespace(client=client)
    data = PromptDataset.from_rows([{"prompt": "after a", "answer": "b"}], "prompt", "answer")
    trainer.evaluator = Evaluator(
        dataset=data, tokenizer=make_tokenizer(), client=client, scorer=None, n=1,
        sampling=SamplingParams(max_tokens=4, temperature=0.0), max_prompt_tokens=32,
        threshold=1.0,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lorarl.trainer.loop"):
        assert trainer._evaluate(3) is None
    assert "eval at step 3 failed; training goes on" in caplog.text
    assert "rollout request failed" in caplog.text


def test_validation_prompts_seen_in_training_are_counted() -> None:
    def data(*prompts):
        return PromptDataset.from_rows([{"prompt": p} for p in prompts], "prompt")

    chat = [{"role": "user", "content": "after b"}]
    train = data("after a", chat, "after c")
    assert shared_prompts(data("after a", "after b", chat, "after d"), train) == 2
    assert shared_prompts(data("after e"), train) == 0
