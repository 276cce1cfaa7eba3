"""Tests build tiny models with the same code the quickstart uses."""

import atexit
import shutil
import tempfile
from pathlib import Path

from lorarl.local.tiny import (
    CHARS,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    make_tiny_model,
    make_tokenizer,
    teach_letter_neighbourhood,
    tiny_config,
)

__all__ = [
    "CHARS",
    "CHAT_TEMPLATE",
    "LINEAR_PARENTS",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "linear_modules",
    "make_tiny_model",
    "make_tokenizer",
    "taught_letter_model",
    "tiny_config",
]

# The linear layers of a Llama/Qwen2 decoder block and the submodule each sits in.
LINEAR_PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def linear_modules(leaves, layers=range(2)) -> list[str]:
    """Hugging Face module names of `leaves` in every layer, e.g. model.layers.0.mlp.up_proj."""
    return [f"model.layers.{i}.{LINEAR_PARENTS[leaf]}.{leaf}" for i in layers for leaf in leaves]


_TAUGHT: dict[tuple[str, int, int], Path] = {}


def taught_letter_model(path: str | Path, letters: str, steps: int = 300, seed: int = 0) -> Path:
    """A tiny Llama (init_std 0.1) taught the letter format (`teach_letter_neighbourhood`) at
    `path`: taught once per test process, then copied. Teaching is seeded and single-threaded, so
    every copy equals a fresh teach; 300 steps took ~33 s, paid by three tests each before."""
    key = (letters, steps, seed)
    if key not in _TAUGHT:
        cache = Path(tempfile.mkdtemp(prefix="lorarl-taught-"))
        atexit.register(shutil.rmtree, cache, True)
        model = make_tiny_model(cache / "model", "llama", seed=seed, init_std=0.1)
        _TAUGHT[key] = teach_letter_neighbourhood(model, letters, steps=steps)
    return Path(shutil.copytree(_TAUGHT[key], path))
