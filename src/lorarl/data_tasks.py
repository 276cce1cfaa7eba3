"""Synthetic verifiable tasks for tests and `make demo`: jsonl rows {prompt, answer, task}.

Chosen from docs/architecture.md#measured-facts: SmolLM2-135M starts at ~0.23 reward on "which is
larger" and ~0.31 on "repeat this 4-digit number" (learnable), ~0.02 on two-digit addition (a
harder control).
Every answer is a bare integer, so the `math_answer` reward (last number) scores them.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "NEXT_LETTER_PROMPTS",
    "TASKS",
    "addition",
    "larger",
    "make_rows",
    "next_letter",
    "repeat",
    "write_task_jsonl",
]

Row = dict[str, str]


def addition(rng: random.Random, digits: int = 2) -> Row:
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return {"prompt": f"What is {a} + {b}? Answer with just the number.", "answer": str(a + b)}


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
