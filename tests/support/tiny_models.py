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
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "make_tiny_model",
    "make_tokenizer",
    "tiny_config",
]
