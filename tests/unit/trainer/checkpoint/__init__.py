"""Unit tests of lorarl.trainer.checkpoint."""
