"""A two-turn environment for the tiny models: the reward depends on what the environment says.

The user asks "after c" (the letter task); whatever the model answers, the environment asks
"after X" for a letter X it draws from the episode's seed, and the episode's reward is 1 when the
second answer is X's successor. X is in no prompt, so only a policy that reads the environment's
message can score above chance.
"""

from __future__ import annotations

import random
import re

from lorarl.environments.base import EnvStep, EpisodeItem, Message, item_messages


class LetterRelay:
    def __init__(self, letters: str = "abcdefgh") -> None:
        if not letters or not letters.isalpha():
            raise ValueError(f"letters must be a non-empty string of letters, got {letters!r}")
        self.letters = letters
        self.turn = 0
        self.target = ""
        self.rng = random.Random(0)

    def reset(self, item: EpisodeItem) -> list[Message]:
        self.rng = random.Random(item.seed)
        return item_messages(item.prompt)

    def step(self, assistant: str) -> EnvStep:
        self.turn += 1
        if self.turn == 1:
            self.target = self.rng.choice(self.letters)
            return EnvStep(messages=[{"role": "user", "content": f"after {self.target}"}])
        successor = chr(ord(self.target) + 1)
        hit = re.match(rf"^.{{0,3}}{successor}", assistant) is not None
        return EnvStep(reward=float(hit), done=True, info={"second_turn": 1.0})
