"""Unit tests of lorarl.server."""
