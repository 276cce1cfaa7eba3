"""Unit tests of lorarl.trainer.update."""
