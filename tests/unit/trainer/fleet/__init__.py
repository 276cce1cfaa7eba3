"""Unit tests of lorarl.trainer.fleet."""
