"""verl's preprocessed GSM8K parquet, written independently of lorarl's converter.

The schema is what verl's examples/data_preprocess/gsm8k.py produces through `datasets`:
data_source, a one-message chat `prompt`, ability, reward_model {style, ground_truth} and
extra_info {split, index, answer, question}.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

VERL_GSM8K_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("answer", pa.string()),
                    ("question", pa.string()),
                ]
            ),
        ),
    ]
)


def verl_row(index: int, question: str, solution: str, final: str, split: str = "train") -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final},
        "extra_info": {"split": split, "index": index, "answer": solution, "question": question},
    }


def write_verl_gsm8k(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=VERL_GSM8K_SCHEMA), path)
    return path
