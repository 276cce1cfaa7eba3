"""Unit tests of lorarl.rewards."""
