"""Unit tests of lorarl.trainer.data."""
