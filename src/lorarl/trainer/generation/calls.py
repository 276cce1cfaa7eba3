"""Small helpers of `RolloutClient`'s calls: URLs, seeds, error text, the sync wrapper."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable
from typing import TypeVar

import httpx

from lorarl.trainer.generation.liveness import ReplicaVanished
from lorarl.trainer.generation.types import SamplingParams

T = TypeVar("T")


def seeded(params: SamplingParams, index: int, n: int) -> SamplingParams:
    """The request of prompt `index` (of `n` samples each) starts at seed + index * n.

    vLLM gives the j-th of a request's n samples seed + j, so prompt i's samples take the seeds
    [seed + i*n, seed + (i+1)*n): no two (prompt, sample) pairs of a call share a random stream,
    a prompt repeated in one batch included (docs/algorithms.md#seeds).
    """
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index * n)


def normalize_url(url: object) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"endpoint {url!r} must be a base URL like http://host:port")
    return url.rstrip("/")


def describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, ReplicaVanished):
        return "stopped answering /health while the request waited (gone?)"
    if isinstance(exc, (asyncio.TimeoutError, httpx.TimeoutException)):
        return f"timed out after {timeout_s:g}s ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def snippet(response: httpx.Response, limit: int = 300) -> str:
    text = response.text.strip().replace("\n", " ")
    return text[:limit] + ("…" if len(text) > limit else "")


def run_sync(coro: Awaitable[T]) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    if hasattr(coro, "close"):
        coro.close()
    raise RuntimeError(
        "RolloutClient's sync methods cannot run inside an event loop; "
        "await the a-prefixed methods (agenerate, ahealth, await_ready) instead"
    )
