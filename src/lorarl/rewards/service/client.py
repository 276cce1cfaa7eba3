"""Trainer-side client of the reward service: `POST /score`, retried, never silently zero.

Connect errors, timeouts and 5xx answers are retried with exponential backoff; a 4xx answer
(bad request, unknown reward, a reward that raised on the data) is not, because repeating it
gives the same answer. When retries run out the client raises `RewardServiceError`, so the
trainer fails the step instead of training on zeros.

Every request carries the job's reward key (`Authorization: Bearer`, `lorarl.rewards.service.auth`):
by default `LORARL_REWARD_API_KEY` from the environment, which the operator (or `lorarl run
--local`) gives the trainer; a 401 says the key is missing or not the service's.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from lorarl.rewards.registry import RewardResult
from lorarl.rewards.service.auth import REWARD_API_KEY_ENV, authorization_header

__all__ = ["RewardServiceClient", "RewardServiceError", "ScoreSample", "sample_to_wire"]

_RETRY_STATUS = frozenset({500, 502, 503, 504})


class RewardServiceError(RuntimeError):
    """The reward service could not score a batch; the message says where and why.

    `unavailable`: it could not be reached or answered 5xx (a pod restarting), as opposed to
    refusing the request (4xx) or answering something unreadable."""

    def __init__(self, message: str, *, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


@dataclass(frozen=True)
class ScoreSample:
    prompt: str
    completion: str
    ground_truth: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


def sample_to_wire(sample: ScoreSample | Mapping[str, Any]) -> dict[str, Any]:
    """A sample as the service expects it (camelCase `groundTruth`)."""
    if isinstance(sample, ScoreSample):
        return {
            "prompt": sample.prompt,
            "completion": sample.completion,
            "groundTruth": sample.ground_truth,
            "metadata": dict(sample.metadata),
        }
    if isinstance(sample, Mapping):
        wire = dict(sample)
        if "ground_truth" in wire:
            wire["groundTruth"] = wire.pop("ground_truth")
        return wire
    raise TypeError(f"a sample must be a ScoreSample or a mapping, got {type(sample).__name__}")


class RewardServiceClient:
    """Scores samples through a reward service at `url`; one instance per trainer is enough."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        reward: str | None = None,
        max_samples_per_request: int = 1024,
        sleep: Callable[[float], None] = time.sleep,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the service's key; None reads `LORARL_REWARD_API_KEY` (unset or empty: no
        Authorization header, which a lorarl reward service answers with 401)."""
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward service url must start with http:// or https:// ({url!r})")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or max_samples_per_request < 1:
            raise ValueError(
                "RewardServiceClient needs timeout_s > 0, max_retries >= 0, backoff_s >= 0 and "
                f"max_samples_per_request >= 1 (got {timeout_s}, {max_retries}, {backoff_s}, "
                f"{max_samples_per_request})"
            )
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.reward = reward
        self.max_samples_per_request = max_samples_per_request
        self._sleep = sleep
        if api_key is None:
            api_key = os.environ.get(REWARD_API_KEY_ENV) or None
        self._has_key = bool(api_key)
        headers = authorization_header(api_key) if api_key else {}
        self._http = httpx.Client(timeout=timeout_s, headers=headers)

    @classmethod
    def from_spec(cls, url: str, service: Any, **kwargs: Any) -> RewardServiceClient:
        """Build from a `RewardServiceSpec` (timeoutSeconds, maxRetries)."""
        return cls(
            url, timeout_s=service.timeout_seconds, max_retries=service.max_retries, **kwargs
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RewardServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def healthy(self) -> bool:
        try:
            return self._http.get(
                f"{self.url}/healthz", timeout=min(5.0, self.timeout_s)
            ).is_success
        except httpx.HTTPError:
            return False

    def score(self, samples: Sequence[ScoreSample | Mapping[str, Any]]) -> list[RewardResult]:
        """One result per sample, in order; large batches go out in chunks."""
        wire = [sample_to_wire(s) for s in samples]
        results: list[RewardResult] = []
        step = self.max_samples_per_request
        for start in range(0, len(wire), step):
            results.extend(self._score_chunk(wire[start : start + step]))
        return results

    def _score_chunk(self, samples: list[dict[str, Any]]) -> list[RewardResult]:
        body: dict[str, Any] = {"samples": samples}
        if self.reward is not None:
            body["reward"] = self.reward
        started = time.monotonic()
        last = "no attempt made"
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            try:
                response = self._http.post(f"{self.url}/score", json=body)
            except httpx.TimeoutException as exc:
                last = f"timed out after {self.timeout_s:g} s ({type(exc).__name__})"
                continue
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code in _RETRY_STATUS:
                last = f"HTTP {response.status_code}: {_detail(response)}"
                continue
            if response.status_code == 401:
                why = "is not the service's" if self._has_key else "is not set"
                raise RewardServiceError(
                    f"reward service {self.url} refused the request with HTTP 401: "
                    f"{_detail(response)} (the trainer's {REWARD_API_KEY_ENV} {why}; not retried)"
                )
            if not response.is_success:
                raise RewardServiceError(
                    f"reward service {self.url} refused the request with HTTP "
                    f"{response.status_code}: {_detail(response)} (not retried)"
                )
            return _parse(response, len(samples), self.url)
        attempts = self.max_retries + 1
        raise RewardServiceError(
            f"reward service {self.url} failed after {attempts} attempt(s) in "
            f"{time.monotonic() - started:.1f} s; last error: {last}",
            unavailable=True,
        )


def _detail(response: httpx.Response) -> str:
    try:
        doc = response.json()
    except ValueError:
        return response.text[:300] or response.reason_phrase
    if isinstance(doc, dict) and "detail" in doc:
        return str(doc["detail"])[:300]
    return str(doc)[:300]


def _parse(response: httpx.Response, n: int, url: str) -> list[RewardResult]:
    try:
        doc = response.json()
        scores, infos = doc["scores"], doc.get("infos") or [{}] * len(doc["scores"])
    except (ValueError, KeyError, TypeError) as exc:
        raise RewardServiceError(f"reward service {url} sent an unreadable answer: {exc}") from exc
    if len(scores) != n or len(infos) != n:
        raise RewardServiceError(
            f"reward service {url} returned {len(scores)} scores and {len(infos)} infos "
            f"for {n} samples"
        )
    results = []
    for i, (score, info) in enumerate(zip(scores, infos, strict=True)):
        if (
            isinstance(score, bool)
            or not isinstance(score, int | float)
            or not math.isfinite(score)
        ):
            raise RewardServiceError(
                f"reward service {url} returned score {score!r} for sample {i}"
            )
        results.append(RewardResult(float(score), dict(info) if isinstance(info, dict) else {}))
    return results
