"""Prompt loading, encoding, resumable sampling, and the synthetic demo tasks."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.workloads.tiny_models import make_tokenizer
from lorarl.data_tasks import make_rows, write_task_jsonl
from lorarl.rewards import get_reward
from lorarl.trainer.data.prompts import (
    DataError,
    DataPosition,
    PromptDataset,
    PromptSampler,
    encode_prompts,
    prompt_text,
)


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ---------------------------------------------------------------- loading


def test_jsonl_rows_answers_and_metadata(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            json.dumps({"q": "What is 1 + 2?", "a": 3, "level": "easy"}),
            "",  # blank lines are skipped
            json.dumps({"q": [{"role": "user", "content": "Hi"}], "a": "hello", "id": 7}),
        ],
    )
    ds = PromptDataset.from_file(path, "q", "a")
    assert len(ds) == 2
    assert ds[0].prompt == "What is 1 + 2?"
    assert ds[0].answer == "3"  # numbers become strings for the reward
    assert ds[0].metadata == {"level": "easy"}
    assert ds[1].prompt == [{"role": "user", "content": "Hi"}]
    assert ds[1].metadata == {"id": 7}
    assert PromptDataset.from_file(path, "q")[0].answer is None


def test_parquet_with_chat_messages(tmp_path):
    table = pa.table(
        {
            "prompt": [
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                [{"role": "user", "content": "3+3?"}],
            ],
            "answer": ["4", "6"],
        }
    )
    path = tmp_path / "d.parquet"
    pq.write_table(table, path)
    ds = PromptDataset.from_file(path, "prompt", "answer")
    assert [item.answer for item in ds] == ["4", "6"]
    assert ds[1].prompt == [{"role": "user", "content": "3+3?"}]
    assert prompt_text(ds[0].prompt) == "2+2?"


def test_system_prompt_wraps_strings_and_respects_a_rows_own(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            json.dumps({"p": "Q1"}),
            json.dumps(
                {"p": [{"role": "system", "content": "own"}, {"role": "user", "content": "Q2"}]}
            ),
        ],
    )
    ds = PromptDataset.from_file(path, "p", system_prompt="Think step by step.")
    assert ds[0].prompt == [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "Q1"},
    ]
    assert ds[1].prompt[0] == {"role": "system", "content": "own"}


def test_from_files_concatenates_in_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [json.dumps({"q": "1"}), json.dumps({"q": "2"})])
    b = tmp_path / "b.parquet"
    pq.write_table(pa.table({"q": ["3"]}), b)
    ds = PromptDataset.from_files([a, b], "q")
    assert [item.prompt for item in ds] == ["1", "2", "3"]
    with pytest.raises(DataError, match="no dataset files"):
        PromptDataset.from_files([], "q")


@pytest.mark.parametrize(
    ("lines", "args", "message"),
    [
        (['{"q": "x"}', '{"question": "y"}'], ("q",), r"d\.jsonl:2: row is missing prompt key 'q'"),
        (['{"q": "x"}', "", '{"q": "y",}'], ("q",), r"d\.jsonl:3: malformed JSON line"),
        (['["q", "x"]'], ("q",), r"d\.jsonl:1: expected a JSON object, got list"),
        (["", "  "], ("q",), r"d\.jsonl: dataset is empty"),
        (['{"q": "x"}'], ("q", "a"), r"d\.jsonl:1: row is missing answer key 'a'"),
        (['{"q": "x", "a": [1]}'], ("q", "a"), r"answer key 'a' must be a string or number"),
        (['{"q": ""}'], ("q",), r"d\.jsonl:1: prompt key 'q' is an empty string"),
        (['{"q": 5}'], ("q",), r"prompt key 'q' must be a string or a non-empty list"),
        (['{"q": [{"role": "user"}]}'], ("q",), r"d\.jsonl:1: prompt key 'q' message 0 must be"),
    ],
)
def test_jsonl_errors_name_file_line_and_key(tmp_path, lines, args, message):
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(DataError, match=message):
        PromptDataset.from_file(path, *args)


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: dataset file not found"):
        PromptDataset.from_file(tmp_path / "nope.jsonl", "q")
    (tmp_path / "d.csv").write_text("q\nx\n")
    with pytest.raises(DataError, match=r"unknown dataset extension '\.csv'; supported: \.jsonl"):
        PromptDataset.from_file(tmp_path / "d.csv", "q")
    with pytest.raises(DataError, match=r"folder holds no \.jsonl or \.parquet shards"):
        PromptDataset.from_file(tmp_path, "q")  # only d.csv in it
    assert issubclass(DataError, ValueError)


def test_parquet_errors(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["x"]}), path)
    with pytest.raises(DataError, match=r"prompt key 'q' is not a column; columns: question"):
        PromptDataset.from_file(path, "q")
    pq.write_table(pa.table({"q": ["x", None]}), path)
    with pytest.raises(DataError, match=r"d\.parquet: row 2: prompt key 'q' must be a string"):
        PromptDataset.from_file(path, "q")
    pq.write_table(pa.table({"q": pa.array([], pa.string())}), path)
    with pytest.raises(DataError, match="dataset is empty"):
        PromptDataset.from_file(path, "q")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="cannot read parquet"):
        PromptDataset.from_file(tmp_path / "bad.parquet", "q")


# ---------------------------------------------------------------- encoding


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def decode(tokenizer, ids):
    return tokenizer.decode(ids)


def test_encode_applies_chat_template(tokenizer):
    [ids] = encode_prompts(tokenizer, ["12+3?"], max_prompt_tokens=64)
    assert decode(tokenizer, ids) == "user: 12+3?\nassistant: "
    assert len(ids) == len("user: 12+3?\nassistant: ")  # one token per character, no BOS
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    [ids] = encode_prompts(tokenizer, [messages], max_prompt_tokens=64)
    assert decode(tokenizer, ids) == "system: S\nuser: Q\nassistant: "


def test_encode_without_template_uses_raw_text():
    tok = make_tokenizer()
    tok.chat_template = None
    [a, b] = encode_prompts(tok, ["abc", [{"role": "user", "content": "x"}] * 2], 64)
    assert decode(tok, a) == "abc"
    assert decode(tok, b) == "x\n\nx"


def test_encode_over_limit_raises_or_truncates_left(tokenizer):
    prompts = ["ab", "hello world"]  # 6 + len + 12 template chars: 20 and 29 tokens
    full = encode_prompts(tokenizer, prompts, 64)
    assert [len(ids) for ids in full] == [20, 29]
    with pytest.raises(DataError, match="prompt 1 has 29 tokens, over max_prompt_tokens=20"):
        encode_prompts(tokenizer, prompts, 20)
    short = encode_prompts(tokenizer, prompts, 20, truncate=True)
    assert short[0] == full[0]  # exactly at the limit: untouched
    assert short[1] == full[1][-20:]
    assert decode(tokenizer, short[1]).endswith("assistant: ")


# ---------------------------------------------------------------- sampling


def test_each_epoch_is_a_permutation_seeded_by_epoch():
    sampler = PromptSampler(n_items=10, batch_size=5, seed=3)
    p0, p1 = sampler.permutation(0), sampler.permutation(1)
    assert sorted(p0) == sorted(p1) == list(range(10))
    assert p0 != p1
    assert PromptSampler(10, 2, seed=4).permutation(0) == p1  # epoch e uses seed + e
    assert PromptSampler(10, 5, seed=3, shuffle=False).permutation(7) == list(range(10))


def test_permutation_stream_is_pinned():
    # Pins torch's CPU randperm stream: if a torch upgrade changes it, resuming an old checkpoint
    # would replay different prompts, and this test says so.
    assert PromptSampler(8, 4, seed=0).permutation(0) == [4, 0, 7, 3, 2, 5, 1, 6]


def test_batches_straddle_epochs_and_stay_full():
    sampler = PromptSampler(n_items=5, batch_size=3, seed=11)
    p0, p1, p2 = (sampler.permutation(e) for e in range(3))
    pos = DataPosition()
    batches = []
    for _ in range(5):
        batch, pos = sampler.next_batch(pos)
        batches.append(batch)
    assert batches == [p0[0:3], p0[3:5] + p1[0:1], p1[1:4], p1[4:5] + p2[0:2], p2[2:5]]
    assert pos == DataPosition(epoch=3, index=0)  # a finished epoch rolls over


def test_batch_larger_than_dataset_spans_epochs():
    sampler = PromptSampler(n_items=2, batch_size=5, seed=0)
    batch, pos = sampler.next_batch(DataPosition())
    expected = sampler.permutation(0) + sampler.permutation(1) + sampler.permutation(2)[:1]
    assert batch == expected
    assert pos == DataPosition(epoch=2, index=1)


def test_resume_from_saved_position_replays_the_same_batches():
    uninterrupted = PromptSampler(n_items=13, batch_size=4, seed=42)
    pos = DataPosition()
    expected = []
    for _ in range(12):
        batch, pos = uninterrupted.next_batch(pos)
        expected.append(batch)

    first = PromptSampler(n_items=13, batch_size=4, seed=42)
    pos, got = DataPosition(), []
    for _ in range(5):
        batch, pos = first.next_batch(pos)
        got.append(batch)
    saved = json.dumps(pos.to_dict())  # what a checkpoint stores

    resumed = PromptSampler(n_items=13, batch_size=4, seed=42)  # a fresh process
    pos = DataPosition.from_dict(json.loads(saved))
    for _ in range(7):
        batch, pos = resumed.next_batch(pos)
        got.append(batch)
    assert got == expected


def test_position_validation():
    with pytest.raises(ValueError, match=r"DataPosition\.index must be an integer >= 0"):
        DataPosition(epoch=0, index=-1)
    with pytest.raises(ValueError, match="missing"):
        DataPosition.from_dict({"epoch": 1})
    with pytest.raises(ValueError, match="did the dataset change"):
        PromptSampler(4, 2, seed=0).next_batch(DataPosition(epoch=0, index=4))
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(4, 0, seed=0)


# ---------------------------------------------------------------- synthetic tasks


def test_addition_rows_are_correct():
    for row in make_rows("addition", 50, seed=1):
        a, b = map(int, re.match(r"What is (\d+) \+ (\d+)\?", row["prompt"]).groups())
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert row["answer"] == str(a + b)


def test_larger_and_repeat_rows_are_correct():
    for row in make_rows("larger", 50, seed=2):
        a, b = map(int, re.findall(r"\d+", row["prompt"]))
        assert a != b and row["answer"] == str(max(a, b))
    for row in make_rows("repeat", 50, seed=2):
        [n] = re.findall(r"\d+", row["prompt"])
        assert len(n) == 4 and row["answer"] == n


def test_multiply_rows_are_correct():
    rows = make_rows("multiply", 50, seed=3)
    for row in rows:
        a, b = map(int, re.fullmatch(r"What is (\d+) \* (\d+)\?", row["prompt"]).groups())
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert row["answer"] == str(a * b) and row["task"] == "multiply"
    assert len({r["prompt"] for r in rows}) > 45  # not one question repeated
    [small] = make_rows("multiply", 1, seed=3, digits=1)
    a, b = map(int, re.findall(r"\d+", small["prompt"]))
    assert a < 10 and b < 10 and small["answer"] == str(a * b)


def test_multiply_tools_rows_demonstrate_calls_the_environment_runs():
    """The worked turns must be what the tool_calling environment parses and answers, or the
    model copies a format that earns nothing."""
    from lorarl.environments.base import EpisodeItem
    from lorarl.environments.tool_calling import ToolCalling
    from lorarl.trainer.data.prompts import prompt_text

    for row in make_rows("multiply-tools", 5, seed=4):
        *demo, question = row["prompt"]
        a, b = map(int, re.fullmatch(r"What is (\d+) \* (\d+)\?", question["content"]).groups())
        assert question["role"] == "user" and row["answer"] == str(a * b)
        assert prompt_text(row["prompt"]) == question["content"]  # what the reward sees
        assert [m["role"] for m in demo] == ["user", "assistant", "tool", "assistant"] * 2
        for i in (1, 5):
            env = ToolCalling(tools=["calculator"])
            env.reset(EpisodeItem(prompt=demo[:i]))
            step = env.step(demo[i]["content"])
            assert step.info == {"tool_calls": 1.0, "tool_errors": 0.0}
            assert step.messages == [demo[i + 1]]  # the demo's tool turn is the real reply
            a, b = map(int, re.findall(r"\d+", demo[i - 1]["content"]))
            assert demo[i + 2]["content"].endswith(f"= {a * b}.")


def test_tasks_are_seeded():
    assert make_rows("addition", 20, seed=5) == make_rows("addition", 20, seed=5)
    assert make_rows("addition", 20, seed=5) != make_rows("addition", 20, seed=6)
    with pytest.raises(ValueError, match="unknown task 'sub'; known tasks: addition, larger"):
        make_rows("sub", 3)


def test_written_task_loads_and_scores(tmp_path):
    path = write_task_jsonl(tmp_path / "sub" / "add.jsonl", "addition", 8, seed=0)
    ds = PromptDataset.from_file(path, "prompt", "answer")
    assert len(ds) == 8 and ds[0].metadata == {"task": "addition"}
    reward = get_reward("math_answer")
    item = ds[0]
    a, b = map(int, re.findall(r"\d+", item.prompt))
    assert reward(item.prompt, f"{a} + {b} is {a + b}.", item.answer, item.metadata).score == 1.0
    assert reward(item.prompt, f"{a + b} or {a + b + 1}", item.answer, item.metadata).score == 0.0


def test_long_prompts_are_dropped_at_load_and_nothing_left_fails_fast(tokenizer):
    """Issue 13 #9: a prompt over maxPromptTokens used to fail the step that sampled it."""
    from lorarl.trainer.data.prompts import PromptDataset, drop_long_prompts

    rows = [{"prompt": "ab", "answer": "1"}, {"prompt": "hello world", "answer": "2"},
            {"prompt": "c", "answer": "3"}]  # fmt: skip  # 20, 29 and 19 tokens rendered
    data = PromptDataset.from_rows(rows, "prompt", "answer", source="t.jsonl")
    kept, dropped = drop_long_prompts(data, tokenizer, 20)
    assert dropped == 1 and [it.answer for it in kept] == ["1", "3"]
    assert encode_prompts(tokenizer, [it.prompt for it in kept], 20)  # every kept one encodes
    with pytest.raises(DataError, match=r"all 3 prompts are longer than data.maxPromptTokens=10"):
        drop_long_prompts(data, tokenizer, 10)
