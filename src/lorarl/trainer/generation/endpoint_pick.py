"""Which rollout replica gets the next request: least outstanding requests, ties round-robin,
failed ones cooling down (a dead replica fails instantly and so always looks least loaded)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class RolloutError(RuntimeError):
    """A rollout request could not be served; names the endpoint(s) and the last error."""

    def __init__(self, message: str, *, endpoints: Sequence[str], last_error: str = "") -> None:
        super().__init__(message)
        self.endpoints = list(endpoints)
        self.last_error = last_error


@dataclass
class EndpointState:
    """Per-endpoint bookkeeping; `outstanding` counts requests assigned and not yet finished."""

    url: str
    outstanding: int = 0
    consecutive_failures: int = 0
    cooldown_until: float = 0.0
    requests: int = 0
    failures: int = 0
    serving: bool = True  # False: its engine is not on the current weights; send it nothing


def pick_endpoint(states: Sequence[EndpointState], *, tried: set[int], now: float, rr: int) -> int:
    """Index of the endpoint for the next attempt.

    Untried endpoints first (all, once every one was tried); among those, ones not cooling down,
    then the fewest outstanding requests, then round-robin order starting at `rr`. When all are
    cooling down, the one that recovers first.
    """
    count = len(states)
    serving = [i for i in range(count) if states[i].serving]
    if not serving:
        raise RolloutError(
            "no rollout engine is serving the current weights",
            endpoints=[s.url for s in states],
        )
    candidates = [i for i in serving if i not in tried] or serving

    def key(i: int) -> tuple[bool, float, int, int]:
        cooling = states[i].cooldown_until > now
        return (
            cooling,
            states[i].cooldown_until if cooling else 0.0,
            states[i].outstanding,
            (i - rr) % count,
        )

    return min(candidates, key=key)
