"""Unit tests of lorarl.operator."""
