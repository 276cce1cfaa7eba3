"""The data users already have (issue 14 #4): verl's parquet, dotted keys, shard folders,
`datasets.save_to_disk` folders, chat-template kwargs, and the local GSM8K converter."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.workloads.tiny_models import make_tokenizer
from harness.workloads.verl_data import INSTRUCTION, verl_row, write_verl_gsm8k
from lorarl.cli.main import main
from lorarl.rewards import get_reward
from lorarl.rewards.registry import RewardResult
from lorarl.trainer.data.prompts import (
    DataError,
    DataPosition,
    PromptDataset,
    PromptSampler,
    drop_long_prompts,
    encode_prompts,
)
from lorarl.trainer.generation.rollouts import RolloutWorker
from lorarl.trainer.generation.types import Sample, SamplingParams

GSM8K = [  # (question, solution) in the GSM8K dataset's own format
    ("Tom has 3 apples and buys 4. How many?", "3 + 4 = <<3+4=7>>7\n#### 7"),
    ("A car costs 1,200 dollars twice. Total?", "1200 * 2 = 2400\n#### 2,400"),
    ("Owes 5, pays 8. Balance?", "5 - 8 = -3\n#### -3"),
]
FINALS = ["7", "2400", "-3"]


def verl_rows() -> list[dict]:
    return [verl_row(i, q, s, f) for i, ((q, s), f) in enumerate(zip(GSM8K, FINALS, strict=True))]


# ---------------------------------------------------------------- verl's parquet, dotted keys


def test_verl_gsm8k_parquet_loads_as_is(tmp_path):
    path = write_verl_gsm8k(tmp_path / "train.parquet", verl_rows())
    ds = PromptDataset.from_file(path, "prompt", "reward_model.ground_truth")
    assert [it.answer for it in ds] == FINALS
    assert ds[0].prompt == [{"role": "user", "content": f"{GSM8K[0][0]} {INSTRUCTION}"}]
    assert ds[1].metadata["extra_info"]["index"] == 1  # the rest reaches the reward as metadata
    assert ds[1].metadata["data_source"] == "openai/gsm8k"
    # The ground truth is what the math reward scores a GSM8K-style completion against.
    reward = get_reward("math_answer")
    assert reward("", "so 1200 * 2 = 2400\n#### 2400", ds[1].answer, ds[1].metadata).score == 1.0
    assert reward("", "#### 2401", ds[1].answer, {}).score == 0.0


def test_dotted_keys_and_their_errors(tmp_path):
    path = write_verl_gsm8k(tmp_path / "d.parquet", verl_rows())
    ds = PromptDataset.from_file(path, "extra_info.question", "extra_info.index")
    assert [it.prompt for it in ds] == [q for q, _ in GSM8K]
    assert [it.answer for it in ds] == ["0", "1", "2"]
    with pytest.raises(DataError, match=r"answer key 'rm\.ground_truth' is not a column"):
        PromptDataset.from_file(path, "prompt", "rm.ground_truth")
    with pytest.raises(DataError, match=r"d\.parquet: row 1: row is missing answer key 'reward"):
        PromptDataset.from_file(path, "prompt", "reward_model.truth")
    # A literal top-level key with a dot in its name wins over the nested lookup.
    rows = [{"a.b": "flat", "a": {"b": "nested"}, "p": "q"}]
    assert PromptDataset.from_rows(rows, "p", "a.b")[0].answer == "flat"
    assert PromptDataset.from_rows([{"a": {"b": 3}, "p": "q"}], "p", "a.b")[0].answer == "3"


# ---------------------------------------------------------------- folders


def test_folder_of_shards_reads_in_name_order(tmp_path):
    shards = tmp_path / "train"
    shards.mkdir()
    rows = verl_rows()
    write_verl_gsm8k(shards / "part-01.parquet", rows[2:])
    write_verl_gsm8k(shards / "part-00.parquet", rows[:2])
    (shards / "part-02.jsonl").write_text(json.dumps({"prompt": "hi", "x": {"y": "9"}}) + "\n")
    (shards / ".part-03.parquet.tmp").write_text("half written")  # hidden: skipped
    (shards / "README.md").write_text("not data")  # other extensions: skipped
    ds = PromptDataset.from_files([shards], "prompt")
    assert [it.metadata.get("reward_model", {}).get("ground_truth") for it in ds] == [
        *FINALS,
        None,
    ]
    assert ds[3].prompt == "hi"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"empty: folder holds no \.jsonl or \.parquet shards"):
        PromptDataset.from_file(empty, "prompt")


def test_save_to_disk_folder(tmp_path):
    # Written by the real `datasets` (shuffled and selected: its indices mapping must apply).
    dset = datasets.Dataset.from_list(verl_rows() * 3).shuffle(seed=1).select(range(7))
    dset.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    ds = PromptDataset.from_file(tmp_path / "saved", "prompt", "reward_model.ground_truth")
    assert [it.answer for it in ds] == [r["reward_model"]["ground_truth"] for r in dset]
    assert [it.prompt for it in ds] == [r["prompt"] for r in dset]

    datasets.DatasetDict({"train": dset, "test": dset}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"a DatasetDict with splits train, test; name one"):
        PromptDataset.from_file(tmp_path / "dd", "prompt")
    assert len(PromptDataset.from_file(tmp_path / "dd" / "test", "prompt")) == 7

    (tmp_path / "saved" / "data-00001-of-00002.arrow").write_bytes(b"truncated")
    with pytest.raises(DataError, match=r"data-00001-of-00002\.arrow: cannot read arrow shard"):
        PromptDataset.from_file(tmp_path / "saved", "prompt")


# ---------------------------------------------------------------- chat template kwargs

THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}(no think){% endif %}{% endif %}"
)


class RecordingClient:
    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def generate(self, prompts, n, params, *, model=None, expected_version=0):
        self.prompts.extend(list(p) for p in prompts)
        one = [5], [-1.0], "stop", 0, "fake"
        return [[Sample(list(p), *one) for _ in range(n)] for p in prompts]


def test_chat_template_kwargs_reach_every_rendering():
    tok = make_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    rows = [{"prompt": "ab", "answer": "1"}]
    kwargs = {"enable_thinking": False}
    plain = encode_prompts(tok, ["ab"], 512)[0]
    off = encode_prompts(tok, ["ab"], 512, chat_template_kwargs=kwargs)[0]
    assert tok.decode(off).endswith("(no think)") and not tok.decode(plain).endswith("(no think)")

    ds = PromptDataset.from_rows(rows, "prompt", "answer")
    ds = PromptDataset(list(ds), chat_template_kwargs=kwargs)
    # Load-time length filter: the kwargs make the prompt longer, so a limit between the two
    # lengths keeps it only without them.
    with pytest.raises(DataError, match="all 1 prompts are longer"):
        drop_long_prompts(ds, tok, len(plain))
    kept, _ = drop_long_prompts(ds, tok, len(off))
    assert kept.chat_template_kwargs == kwargs

    client = RecordingClient()
    RolloutWorker(
        dataset=kept, sampler=PromptSampler(1, 1, seed=0), tokenizer=tok, client=client,
        scorer=lambda p, c, t, m: [RewardResult(score=0.0) for _ in c], estimator="grpo",
        group_size=2, max_prompt_tokens=512, sampling=SamplingParams(max_tokens=4),
    ).collect(DataPosition(), 0, "base")  # fmt: skip
    assert client.prompts == [off]  # what the engines are asked to continue


def test_from_files_carries_chat_template_kwargs(tmp_path):
    path = write_verl_gsm8k(tmp_path / "d.parquet", verl_rows())
    ds = PromptDataset.from_files(
        [path], "prompt", "reward_model.ground_truth", chat_template_kwargs={"enable_thinking": 0}
    )
    assert ds.chat_template_kwargs == {"enable_thinking": 0}


# ---------------------------------------------------------------- lorarl prepare task gsm8k


def test_prepare_gsm8k_converts_a_local_copy_like_verl(tmp_path):
    src = tmp_path / "gsm8k-train.jsonl"
    src.write_text("".join(json.dumps({"question": q, "answer": s}) + "\n" for q, s in GSM8K))
    out = tmp_path / "out" / "train.parquet"
    r = CliRunner().invoke(main, ["prepare", "task", "gsm8k", "--from", str(src), "-o", str(out)])
    assert r.exit_code == 0, r.output
    expected = write_verl_gsm8k(tmp_path / "expected.parquet", verl_rows())
    assert pq.read_table(out).equals(pq.read_table(expected))
    assert [p.name for p in out.parent.iterdir()] == ["train.parquet"]  # no temp file left

    # The HF dataset's own parquet layout converts the same way.
    pq.write_table(pa.Table.from_pylist([{"question": q, "answer": s} for q, s in GSM8K]), src)
    src.rename(tmp_path / "test-00000.parquet")
    r = CliRunner().invoke(
        main,
        ["prepare", "task", "gsm8k", "--from", str(tmp_path / "test-00000.parquet"), "-o",
         str(out), "--split", "test"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert pq.read_table(out).column("extra_info").to_pylist()[2]["split"] == "test"


def test_prepare_gsm8k_errors(tmp_path):
    runner = CliRunner()
    r = runner.invoke(main, ["prepare", "task", "gsm8k", "-o", str(tmp_path / "o.parquet")])
    assert r.exit_code == 2 and "gsm8k needs --from PATH" in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    r = runner.invoke(
        main, ["prepare", "task", "gsm8k", "--from", str(bad), "-o", str(tmp_path / "o.parquet")]
    )
    assert r.exit_code == 1 and "bad.jsonl:1: answer has no '#### <number>' line" in r.output
    assert not (tmp_path / "o.parquet").exists()
    r = runner.invoke(
        main, ["prepare", "task", "larger", "--from", str(bad), "-o", str(tmp_path / "o.jsonl")]
    )
    assert r.exit_code == 2 and "--from is for gsm8k only" in r.output
    r = runner.invoke(
        main, ["prepare", "task", "gsm8k", "--from", str(bad), "-n", "5", "-o", "o.parquet"]
    )
    assert r.exit_code == 2 and "--rows does not apply to gsm8k" in r.output
    r = runner.invoke(main, ["prepare", "task", "larger", "--split", "test", "-o", "o.jsonl"])
    assert r.exit_code == 2 and "--split does not apply to larger" in r.output
