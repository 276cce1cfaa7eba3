"""Unit tests of lorarl.trainer."""
