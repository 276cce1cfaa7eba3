"""Errors a user can cause and fix (a missing file, extra or interpreter, no cluster): the CLI
prints their message as one line and exits 1, never a traceback. Anything else is a bug and
keeps its traceback."""

from __future__ import annotations


class UserError(RuntimeError):
    """Its message is complete and says what to do; no traceback is shown for it."""
