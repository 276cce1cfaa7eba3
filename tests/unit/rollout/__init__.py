"""Unit tests of lorarl.rollout."""
