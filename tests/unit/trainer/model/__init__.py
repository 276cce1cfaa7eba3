"""Unit tests of lorarl.trainer.model."""
