"""Unit tests of lorarl.environments."""
