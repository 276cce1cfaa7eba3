"""The environment protocol of multi-turn rollouts (`spec.environment`,
docs/architecture.md#multi-turn-rollouts).

One environment instance runs one episode. The rollout side owns the tokens: it renders the
messages an environment returns with the model's chat template and appends them, as tokens the
loss never sees, after the model's own sampled tokens; it never re-tokenizes an earlier turn.
An environment only ever sees and returns text messages.

Methods may be plain or `async`; plain ones run in a worker thread, so a slow tool does not stall
the other episodes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]  # {"role": "user" | "tool" | "system" | ..., "content": str}


@dataclass(frozen=True)
class EpisodeItem:
    """What `reset` gets: one dataset row and this episode's seed.

    `prompt` is the row's prompt as the dataset holds it: a string or a list of chat messages
    (with `data.systemPrompt` already in front). `seed` differs per episode of a group and is
    reproducible for a given job seed, step and sample.
    """

    prompt: str | list[Message]
    answer: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0


@dataclass
class EnvStep:
    """What `step` returns after one assistant turn.

    `messages` are appended to the conversation (e.g. a tool result as role "tool", or a new user
    turn); `reward` is this turn's reward, summed over the episode; `done` ends the episode.
    `info` counters summed into the step's metrics: "tool_calls", "tool_errors".
    """

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """Gym-like, text in and text out; constructed as `Class(**environment.params)` once per
    episode."""

    def reset(self, item: EpisodeItem) -> list[Message] | Awaitable[list[Message]]:
        """The episode's first messages: the conversation the model answers first."""
        ...

    def step(self, assistant: str) -> EnvStep | Awaitable[EnvStep]:
        """React to the model's reply (its text, special tokens removed)."""
        ...


class EnvironmentContractError(RuntimeError):
    """Raised by the runner when an environment breaks its contract (names the class)."""


def item_messages(prompt: str | list[Message]) -> list[Message]:
    """A dataset prompt as chat messages (a bare string is one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]
