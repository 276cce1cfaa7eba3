"""Unit tests of lorarl.api."""
