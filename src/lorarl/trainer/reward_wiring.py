"""The trainer's side of a remote reward service: wait for it, score through it."""

from __future__ import annotations

import time

from lorarl.rewards.client import RewardServiceClient, RewardServiceError, ScoreSample

REWARD_READY_TIMEOUT_S = 600.0


def wait_for_reward_service(
    client: RewardServiceClient, timeout_s: float, poll_s: float = 0.5
) -> None:
    """Block until the service's /healthz answers 200; fail the run with its URL otherwise."""
    deadline = time.monotonic() + timeout_s
    while not client.healthy():
        if time.monotonic() > deadline:
            raise RewardServiceError(
                f"reward service {client.url} was not healthy (GET /healthz) within {timeout_s:g} s"
            )
        time.sleep(poll_s)


def _score_remote(client: RewardServiceClient, prompts, completions, truths, metadatas):
    """The in-process scorer's signature over the reward service."""
    samples = [
        ScoreSample(prompt=p, completion=c, ground_truth=t, metadata=m or {})
        for p, c, t, m in zip(prompts, completions, truths, metadatas, strict=True)
    ]
    return client.score(samples)
