"""The trainer's side of a remote reward service: wait for it, score through it."""

from __future__ import annotations

import logging
import time

from lorarl.rewards.service.client import RewardServiceClient, RewardServiceError, ScoreSample

REWARD_READY_TIMEOUT_S = 600.0
OUTAGE_ROUNDS = 3  # waits for a reward service that went away, per batch

log = logging.getLogger(__name__)


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


def score_remote(
    client: RewardServiceClient,
    prompts,
    completions,
    truths,
    metadatas,
    *,
    outage_timeout_s: float = REWARD_READY_TIMEOUT_S,
):
    """The in-process scorer's signature over the reward service.

    A service that is down (its pod restarting: connect errors or 5xx after the client's own
    retries) is waited for, like at start-up, and the batch scored again: a reward pod that
    comes back within `outage_timeout_s` costs the step time, not a trainer restart. A refusal
    (4xx) or an outage longer than that still fails the step."""
    samples = [
        ScoreSample(prompt=p, completion=c, ground_truth=t, metadata=m or {})
        for p, c, t, m in zip(prompts, completions, truths, metadatas, strict=True)
    ]
    for attempt in range(OUTAGE_ROUNDS):
        try:
            return client.score(samples)
        except RewardServiceError as exc:
            if not exc.unavailable or attempt == OUTAGE_ROUNDS - 1:
                raise
            log.warning("reward service unavailable (%s); waiting for it to come back", exc)
            wait_for_reward_service(client, outage_timeout_s)
    raise AssertionError("unreachable")
