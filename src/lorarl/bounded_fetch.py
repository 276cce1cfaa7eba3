"""GET a JSON document from a peer we do not trust to behave: capped in bytes and in total time.

A trainer's progress endpoint is reached by name inside the cluster; whoever answers there (a
hijacked pod, a bug) must not be able to make the status API or the operator parse a giant body
or hold a thread with a slow trickle. httpx's timeouts are per read, so a peer sending one byte a
second never trips them; here the whole exchange (connect, headers, body) runs under one asyncio
deadline, and the body is read raw (no decompression: `Accept-Encoding: identity`, anything else
is refused) into a buffer that stops at `max_bytes`.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any, TypeVar

import httpx

MiB = 1024 * 1024
DEADLINE_S = 3.0
# The trainer's endpoints: a Progress is a few KiB; a StepRecord with every field set is about
# 0.9 KiB of JSON, so the history cap holds some 18k steps.
MAX_PROGRESS_BYTES = 1 * MiB
MAX_HISTORY_BYTES = 16 * MiB
T = TypeVar("T")


class FetchError(RuntimeError):
    """The peer did not answer, answered an error, or answered too much or too slowly."""


async def get_json(
    client: httpx.AsyncClient, url: str, *, max_bytes: int, deadline_s: float = DEADLINE_S
) -> Any:
    """The parsed JSON at `url`, or FetchError; never more than `max_bytes` read, nor longer than
    `deadline_s` seconds spent, whatever the peer does."""
    body = bytearray()
    try:
        async with asyncio.timeout(deadline_s):
            headers = {"Accept-Encoding": "identity"}
            async with client.stream("GET", url, headers=headers) as response:
                if response.status_code != 200:
                    raise FetchError(f"{url}: HTTP {response.status_code}")
                encoding = response.headers.get("content-encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    raise FetchError(f"{url}: refusing a {encoding!r}-encoded body")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise FetchError(f"{url}: body of {declared} bytes is over {max_bytes} bytes")
                async for chunk in response.aiter_raw():
                    body += chunk
                    if len(body) > max_bytes:
                        raise FetchError(f"{url}: body is over {max_bytes} bytes")
    except TimeoutError as exc:
        raise FetchError(f"{url}: no complete answer within {deadline_s:g} s") from exc
    except httpx.HTTPError as exc:
        raise FetchError(f"{url}: {exc or type(exc).__name__}") from exc
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise FetchError(f"{url}: not JSON ({type(exc).__name__})") from exc


@cache
def _ssl_context() -> ssl.SSLContext:
    # Building a default context costs ~20 ms; the sync helper makes a client per call.
    return ssl.create_default_context()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, also from a thread whose event loop is already running."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def get_json_sync(
    url: str, *, max_bytes: int, deadline_s: float = DEADLINE_S, read_timeout: float = 2.0
) -> Any:
    """`get_json` for blocking callers (the status API's sync routes): one short-lived client per
    call, so the deadline can cancel anything, the connect and the headers included."""

    async def fetch() -> Any:
        async with httpx.AsyncClient(
            timeout=read_timeout, trust_env=False, verify=_ssl_context()
        ) as client:
            return await get_json(client, url, max_bytes=max_bytes, deadline_s=deadline_s)

    return _run(fetch())
