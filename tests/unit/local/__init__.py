"""Unit tests of lorarl.local."""
