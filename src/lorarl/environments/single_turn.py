"""`single_turn`: one prompt, one reply, done; plain RL on a dataset as an environment."""

from __future__ import annotations

from lorarl.environments.base import EnvStep, EpisodeItem, Message, item_messages

__all__ = ["SingleTurn"]


class SingleTurn:
    """The row's prompt as the conversation; the first reply ends the episode with reward 0, so
    the episode's reward is spec.reward's score of that reply (docs/environments.md)."""

    def reset(self, item: EpisodeItem) -> list[Message]:
        return item_messages(item.prompt)

    def step(self, assistant: str) -> EnvStep:
        return EnvStep(done=True)
