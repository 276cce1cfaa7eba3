"""Unit tests of lorarl.sync."""
