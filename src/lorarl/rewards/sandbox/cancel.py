"""Cancelling the scoring of one request: its sandboxes killed, its queued samples never started.

The reward service gives each request a `CancelScope` and cancels it when the request's deadline
passes or its caller goes away (the ingress timed out, the HTTP client disconnected). Scoring
runs on worker threads that cannot be interrupted, so the scope reaches the work that costs:

- every `Sandbox` started while a scope is active (`scope.active()`, set on the worker thread
  around one sample) attaches itself to it, and `cancel()` SIGKILLs each live one's pid
  namespace (the kernel then kills everything in it), so the worker's `wait()` returns at once;
- a sample whose scope is already cancelled is not started, and starting a sandbox in a cancelled
  scope raises `ScoringCancelled`, so the rest of a multi-sandbox reward (the next stdin/stdout
  case, the judge after the solution) stops there.

An in-process reward (no sandbox) runs to its end once started; the scope only keeps the ones
queued behind it from starting.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator
from typing import Protocol

__all__ = ["CancelScope", "Cancellable", "ScoringCancelled", "current_scope"]


class ScoringCancelled(Exception):
    """The request this work belonged to was cancelled (deadline passed, or its caller left)."""


class Cancellable(Protocol):
    def cancel(self) -> None: ...


_current: contextvars.ContextVar[CancelScope | None] = contextvars.ContextVar(
    "lorarl_reward_cancel_scope", default=None
)


def current_scope() -> CancelScope | None:
    """The scope active on this thread (None: nothing can cancel this work)."""
    return _current.get()


class CancelScope:
    """Thread-safe: `cancel()` may come from the event loop while worker threads score."""

    def __init__(self, *, deadline: float | None = None) -> None:
        """`deadline`: a `time.monotonic()` instant after which `check()` cancels the scope
        itself (the owner still needs a timer to kill sandboxes that are already running)."""
        self.deadline = deadline
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._live: set[Cancellable] = set()

    @property
    def cancelled(self) -> bool:
        if self._reason is None and self.deadline is not None and time.monotonic() > self.deadline:
            self.cancel("the request's deadline passed")
        return self._reason is not None

    @property
    def reason(self) -> str:
        return self._reason or ""

    def cancel(self, reason: str = "the request was cancelled") -> None:
        """Mark the scope cancelled (the first reason stays) and cancel everything attached."""
        with self._lock:
            if self._reason is None:
                self._reason = reason
            live, self._live = list(self._live), set()
        for item in live:
            item.cancel()

    def check(self) -> None:
        if self.cancelled:
            raise ScoringCancelled(f"scoring cancelled: {self.reason}")

    def attach(self, item: Cancellable) -> None:
        """Track `item` until `detach`; one attached to a cancelled scope is cancelled now."""
        with self._lock:
            if self._reason is None:
                self._live.add(item)
                return
        item.cancel()

    def detach(self, item: Cancellable) -> None:
        with self._lock:
            self._live.discard(item)

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._live)

    @contextlib.contextmanager
    def active(self) -> Iterator[CancelScope]:
        """Make this the current scope on this thread (what `Sandbox` attaches to)."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)
