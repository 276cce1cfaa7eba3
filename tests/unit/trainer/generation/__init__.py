"""Unit tests of lorarl.trainer.generation."""
