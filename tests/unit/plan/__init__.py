"""Unit tests of lorarl.plan."""
