"""The trainer's user-facing error, low enough for every part to raise it (`settings` sits above
the parts: docs/architecture.md, Layers)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A job the trainer cannot run; the message is the one line the user sees."""
