"""Unit tests of lorarl.trainer.episodes."""
