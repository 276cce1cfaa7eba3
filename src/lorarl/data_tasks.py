"""Synthetic verifiable tasks for tests and `make demo`: jsonl rows {prompt, answer, task}; and
GSM8K converted to verl's preprocessed parquet from a local copy (`convert_gsm8k`).

Chosen from docs/architecture.md#measured-facts: SmolLM2-135M starts at ~0.23 reward on "which is
larger" and ~0.31 on "repeat this 4-digit number" (learnable), ~0.02 on two-digit addition (a
harder control), 0.0 on three-digit products (`multiply`, greedy and sampled: the task of the
tool-calling example, bench/results/tools.json).
Every answer is a bare integer, so the `math_answer` reward (last number) scores them.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "NEXT_LETTER_PROMPTS",
    "TASKS",
    "addition",
    "convert_gsm8k",
    "gsm8k_final_answer",
    "gsm8k_verl_rows",
    "larger",
    "make_rows",
    "multiply",
    "multiply_tools",
    "next_letter",
    "repeat",
    "with_tool_demos",
    "write_task_jsonl",
]

Row = dict[str, Any]  # prompt: a string, or chat messages (multiply-tools)


def addition(rng: random.Random, digits: int = 2) -> Row:
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return {"prompt": f"What is {a} + {b}? Answer with just the number.", "answer": str(a + b)}


def multiply(rng: random.Random, digits: int = 3) -> Row:
    """Products a small model cannot do in its head but a calculator tool can: the task of the
    tool-calling example (examples/tool-calling.yaml)."""
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return {"prompt": f"What is {a} * {b}?", "answer": str(a * b)}


# Fixed worked examples, so every row shows the model the same two calls.
TOOL_DEMOS = ((123, 456), (804, 317))


def multiply_tools(rng: random.Random, digits: int = 3) -> Row:
    """`multiply` for the `tool_calling` environment, the question after two worked calculator
    calls (`with_tool_demos`)."""
    return with_tool_demos(multiply(rng, digits))


def with_tool_demos(row: Row) -> Row:
    """The row's question after two worked calculator calls as chat turns (question, the
    `<tool_call>`, the tool's `<tool_response>`, the answer), in the `tool_calling`
    environment's format. Small models copy turns, not instructions: SmolLM2-135M never called
    the tool from a system text alone (0 of 200 questions with the environment's own text, 0 of
    50 with five other wordings, greedy and at temperature 1); after these two turns it made a
    valid call on 200 of 200 greedily (86.5% right in the end) and on 34.5% at temperature 1
    (9.5% right; the rest mostly malformed JSON): a start RL can build on
    (bench/results/tools.json)."""
    turns: list[dict[str, str]] = []
    for a, b in TOOL_DEMOS:
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
        turns += [
            {"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": f"<tool_response>\n{a * b}\n</tool_response>"},
            {"role": "assistant", "content": f"{a} * {b} = {a * b}."},
        ]
    return {**row, "prompt": [*turns, {"role": "user", "content": row["prompt"]}]}


def larger(rng: random.Random, digits: int = 2) -> Row:
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    a, b = rng.sample(range(lo, hi + 1), 2)  # distinct, so there is one right answer
    return {
        "prompt": f"Which is larger: {a} or {b}? Answer with just the number.",
        "answer": str(max(a, b)),
    }


def repeat(rng: random.Random, digits: int = 4) -> Row:
    n = rng.randint(10 ** (digits - 1), 10**digits - 1)
    return {"prompt": f"Repeat this number: {n}. Answer with just the number.", "answer": str(n)}


NEXT_LETTER_PROMPTS = "abcdefgh"  # "after a" .. "after h"; the quickstart's model knows these


def next_letter(rng: random.Random, letters: str = NEXT_LETTER_PROMPTS) -> Row:
    """For tiny random models (the quickstart): "after c" -> "d", scored by `regex_match` on the
    row's `pattern` (the letter within the first four characters)."""
    c = rng.choice(letters)
    nxt = chr(ord(c) + 1)
    return {"prompt": f"after {c}", "answer": nxt, "pattern": f"^.{{0,3}}{nxt}"}


TASKS: dict[str, Callable[..., Row]] = {
    "addition": addition,
    "larger": larger,
    "repeat": repeat,
    "multiply": multiply,
    "multiply-tools": multiply_tools,
    "next-letter": next_letter,
}


def make_rows(task: str, n: int, seed: int = 0, **kwargs: int) -> list[Row]:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(sorted(TASKS))}")
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    rng = random.Random(f"{task}:{seed}")  # per-task stream: same seed, different tasks differ
    return [{**TASKS[task](rng, **kwargs), "task": task} for _ in range(n)]


def write_task_jsonl(path: str | Path, task: str, n: int, seed: int = 0, **kwargs: int) -> Path:
    """Write `n` rows atomically (a crash never leaves half a dataset); returns the path."""
    path = Path(path)
    rows = make_rows(task, n, seed, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------- GSM8K in verl's format

GSM8K_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_GSM8K_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_final_answer(solution: str) -> str | None:
    """The number after "####" in a GSM8K solution, thousands separators removed."""
    match = _GSM8K_FINAL.search(solution)
    return match.group(1).replace(",", "") if match else None


def gsm8k_verl_rows(rows: Sequence[tuple[str, Mapping[str, Any]]], split: str) -> list[dict]:
    """GSM8K records {question, answer} as verl's preprocessing writes them: a one-message chat
    prompt with the step-by-step instruction, and the final number as
    reward_model.ground_truth. `rows` pairs each record with its location for errors."""
    out = []
    for index, (where, record) in enumerate(rows):
        question, solution = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not isinstance(solution, str):
            raise ValueError(f"{where}: a GSM8K row needs string question and answer fields")
        final = gsm8k_final_answer(solution)
        if final is None:
            raise ValueError(f"{where}: answer has no '#### <number>' line")
        out.append(
            {
                "data_source": GSM8K_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": final},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "answer": solution,
                    "question": question,
                },
            }
        )
    return out


def verl_schema():
    """The parquet schema of verl's preprocessed GSM8K (what `datasets` infers for its rows)."""
    import pyarrow as pa

    return pa.schema(
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


def convert_gsm8k(source: str | Path, out: str | Path, split: str = "train") -> Path:
    """A local GSM8K file (jsonl/parquet with question and answer, or a folder of them) as
    verl's parquet, written atomically. Nothing is downloaded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lorarl.trainer.data.files import read_rows

    rows = gsm8k_verl_rows(read_rows(source), split)
    if not rows:
        raise ValueError(f"{source}: no rows")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    pq.write_table(pa.Table.from_pylist(rows, schema=verl_schema()), tmp)
    os.replace(tmp, out)
    return out
