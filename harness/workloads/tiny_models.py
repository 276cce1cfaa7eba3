"""Tests build tiny models with the same code the quickstart uses."""

from lorarl.local.tiny import (
    CHARS,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    make_tiny_model,
    make_tokenizer,
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
