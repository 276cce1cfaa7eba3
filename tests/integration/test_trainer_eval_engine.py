"""The eval on data.valFiles through a real HTTP engine (a tiny transformers model behind vLLM's
completions API) with the job's real reward, built as the trainer builds it."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from harness.engines.hf_engine_server import Controls, create_app, serve_in_thread
from harness.workloads.tiny_models import make_tiny_model, make_tokenizer
from lorarl.api.validation import parse_job
from lorarl.rewards import get_reward, score_batch
from lorarl.trainer.data.prompts import PromptDataset
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.eval import build_evaluator, read_generations
from lorarl.trainer.generation.types import SamplingParams

ALWAYS, NEVER = ".*", "^NEVER$"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Controls]]:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", init_std=0.1)
    app = create_app(model, served_model_name="base")
    url, stop = serve_in_thread(app)
    yield url, app.state.controls
    stop()


def job_with_val(tmp_path: Path, rows: list[dict], **eval_spec):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return parse_job(
        {
            "apiVersion": "lorarl.dev/v1alpha1",
            "kind": "LoRARLJob",
            "metadata": {"name": "t"},
            "spec": {
                "model": {"path": "/m"},
                "data": {
                    "trainFiles": ["t.jsonl"], "valFiles": [str(val)],
                    "maxPromptTokens": 40, "maxResponseTokens": 6,
                },
                "reward": {"function": "regex_match", "params": {"metadata_key": "pattern"}},
                "training": {"evalInterval": 5, "eval": eval_spec, "outputDir": str(tmp_path)},
            },
        }
    )  # fmt: skip


def evaluator(job, url: str, train_prompts=None):
    client = RolloutClient([url], "vllm", model_name="base", timeout_s=60)
    reward = job.spec.reward
    scorer = partial(score_batch, get_reward(reward.function, **reward.params))  # as the trainer
    train = SamplingParams(max_tokens=99, temperature=1.0, seed=7, stop_token_ids=(2,))
    return build_evaluator(job, make_tokenizer(), client, scorer, train, train_prompts)


def test_eval_scores_every_val_prompt_with_the_jobs_reward(tmp_path, engine, caplog) -> None:
    url, controls = engine
    rows = [{"prompt": f"after {c}", "answer": "x", "pattern": p, "data_source": s}
            for c, p, s in zip("abcdef", [ALWAYS, NEVER] * 3, "xxyyzz", strict=True)]  # fmt: skip
    long = "a prompt far longer than the forty tokens this job allows"
    rows.append({"prompt": long, "answer": "x", "pattern": ALWAYS})
    train = PromptDataset.from_rows([{"prompt": "after b"}, {"prompt": "after z"}], "prompt")
    with caplog.at_level(logging.WARNING, logger="lorarl.trainer.generation.eval"):
        ev = evaluator(job_with_val(tmp_path, rows, n=4, temperature=1.0, maxPrompts=4), url, train)
    assert len(ev.dataset) == 4  # the long prompt dropped, then the first 4 kept
    assert "dropped 1 of 7 validation prompts longer than data.maxPromptTokens=40" in caplog.text
    assert "1 of 4 validation prompts are also training prompts" in caplog.text
    assert ev.sampling.max_tokens == 6 and ev.sampling.seed == 7
    before = controls.requests["/v1/completions"]
    rec = ev.run(step=5, version=5, model_name="base")
    assert controls.requests["/v1/completions"] - before == 4  # one request of n=4 per prompt
    assert (rec.step, rec.prompts, rec.samples_per_prompt) == (5, 4, 4)
    assert rec.accuracy == 0.5 and rec.reward_mean == 0.5
    assert rec.pass_at_k == {"1": 0.5, "2": 0.5, "4": 0.5}
    # Per data source (the first 4 prompts: x ALWAYS, x NEVER, y ALWAYS, y NEVER).
    assert {k: (v.accuracy, v.prompts) for k, v in rec.by_source.items()} == {
        "x": (0.5, 2), "y": (0.5, 2)}  # fmt: skip
    # The completions the engine sampled, kept with their rewards under outputDir/evals.
    saved = read_generations(tmp_path / "evals" / "step-000005.jsonl")
    assert [(r["prompt"], r["data_source"]) for r in saved] == [
        ("after a", "x"), ("after b", "x"), ("after c", "y"), ("after d", "y")]  # fmt: skip
    assert [r["rewards"] for r in saved] == [[1.0] * 4, [0.0] * 4, [1.0] * 4, [0.0] * 4]
    assert all(len(r["completions"]) == 4 and r["answer"] == "x" for r in saved)


def test_greedy_eval_is_repeatable_and_judges_the_completions(tmp_path, engine) -> None:
    url, _ = engine
    rows = [{"prompt": f"after {c}", "answer": "x", "pattern": "^.{0,5}[a-m]"} for c in "abcdefgh"]
    ev = evaluator(job_with_val(tmp_path, rows), url)
    assert (ev.n, ev.sampling.temperature) == (1, 0.0)
    first = ev.run(step=0, version=0, model_name="base")
    again = ev.run(step=0, version=0, model_name="base")
    assert first.model_dump(exclude={"seconds"}) == again.model_dump(exclude={"seconds"})
    # The reward saw the engine's completions: the same completions, judged by hand, agree.
    prompt_ids = [ev.tokenizer.apply_chat_template(
        [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
        for r in rows]  # fmt: skip
    ids = [ev.tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompt_ids]
    groups = ev.client.generate(ids, 1, ev.sampling, expected_version=0)
    texts = [ev.tokenizer.decode(g[0].completion_ids, skip_special_tokens=True) for g in groups]
    fn = get_reward("regex_match", metadata_key="pattern")
    by_hand = [score_batch(fn, ["p"], [t], [None], [{"pattern": rows[0]["pattern"]}])[0].score
               for t in texts]  # fmt: skip
    assert first.accuracy == sum(by_hand) / len(by_hand)
