"""Unit tests of lorarl.cli."""
