"""Value types shared by the rollout codecs and the rollout client.

Kept apart from both so the trainer's loss code can import `Sample` without pulling in httpx.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]
Engine = Literal["vllm", "sglang"]
ENGINES: tuple[str, ...] = ("vllm", "sglang")


class WireFormatError(ValueError):
    """An engine answered with a body we cannot turn into samples (names the offending field)."""


@dataclass(frozen=True)
class SamplingParams:
    """Engine-neutral sampling settings; `top_k=None` and `seed=None` mean "engine default".

    `stop` strings end a completion with finish reason "stop"; both engines leave the stop string
    out of the text but keep the tokens that formed it in the ids (and logprobs) we train on.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, minimum=1, hint=" (use None to disable top-k)")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        stops = tuple(self.stop_token_ids)
        for i, tok in enumerate(stops):
            _check_int(f"stop_token_ids[{i}]", tok, minimum=0)
        object.__setattr__(self, "stop_token_ids", stops)
        if isinstance(self.stop, str):
            raise ValueError("stop must be a list of strings, not one string")
        texts = tuple(self.stop)
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {text!r}")
        object.__setattr__(self, "stop", texts)
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        # Both engines accept (0, 2] (SGLang's bound; vLLM takes any positive value).
        if not _finite(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise ValueError(
                f"repetition_penalty must be in (0, 2] (1: off), got {self.repetition_penalty!r}"
            )


@dataclass(frozen=True)
class Sample:
    """One completion: the token ids the trainer trains on and the engine's logprob of each.

    `weight_version` is the policy version that produced it: reported by the engine when it can
    say, else the version the trainer last synced to every replica (see RolloutClient.generate).
    `text` is the engine's detokenized completion, for rewards; training uses `completion_ids`.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int
    endpoint: str
    text: str = field(default="", compare=False)
    # Multi-turn episodes: 1 on the model's tokens, 0 on the environment's (None: all the model's).
    loss_mask: tuple[int, ...] | None = None
    # Multi-turn: (index in completion_ids of a turn's last model token, that turn's reward).
    turn_rewards: tuple[tuple[int, float], ...] | None = None

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"Sample from {self.endpoint}: {len(self.logprobs)} logprobs for "
                f"{len(self.completion_ids)} completion tokens (need one per token)"
            )
        if self.loss_mask is not None and len(self.loss_mask) != len(self.completion_ids):
            raise ValueError(
                f"Sample from {self.endpoint}: {len(self.loss_mask)} loss-mask entries for "
                f"{len(self.completion_ids)} completion tokens"
            )
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(
                f"Sample.finish_reason must be 'stop' or 'length', got {self.finish_reason!r}"
            )


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(name: str, value: object, *, minimum: int, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{hint}, got {value!r}")


def check_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Validate a batch of tokenized prompts early, with the index of the bad one."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of token-id lists")
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or not prompt:
            raise ValueError(
                f"prompts[{i}] must be a non-empty list of token ids, got {prompt!r:.80}"
            )
        for j, tok in enumerate(prompt):
            _check_int(f"prompts[{i}][{j}]", tok, minimum=0)
        out.append(list(prompt))
    return out
