"""Unit tests of lorarl.trainer.telemetry."""
