"""Unit tests of lorarl.trainer.rl."""
