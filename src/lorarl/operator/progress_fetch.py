"""The operator's progress poll: `bounded_fetch.get_json`'s caps over aiohttp.

Every running job is polled each timer interval, so the client's own cost is the operator's
largest steady cost: aiohttp (already loaded by kopf) spends about a third of httpx's CPU per
request. The caps are the same: the whole exchange under one deadline, no decompression, at most
`max_bytes` read, anything else refused.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from lorarl.bounded_fetch import DEADLINE_S, FetchError


async def fetch_bytes(
    session: aiohttp.ClientSession, url: str, *, max_bytes: int, deadline_s: float = DEADLINE_S
) -> bytes:
    """The body at `url`, or FetchError (not up, an error status, too big, too slow)."""
    try:
        async with asyncio.timeout(deadline_s):
            async with session.get(url, headers={"Accept-Encoding": "identity"}) as response:
                if response.status != 200:
                    raise FetchError(f"{url}: HTTP {response.status}")
                encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    raise FetchError(f"{url}: refusing a {encoding!r}-encoded body")
                if response.content_length is not None and response.content_length > max_bytes:
                    raise FetchError(
                        f"{url}: body of {response.content_length} bytes is over {max_bytes} bytes"
                    )
                body = await response.content.read(max_bytes + 1)
                if len(body) > max_bytes:
                    raise FetchError(f"{url}: body is over {max_bytes} bytes")
    except TimeoutError as exc:
        raise FetchError(f"{url}: no complete answer within {deadline_s:g} s") from exc
    except (aiohttp.ClientError, ValueError) as exc:
        raise FetchError(f"{url}: {exc or type(exc).__name__}") from exc
    return body


def parse_json(url: str, body: bytes) -> Any:
    """`body` parsed, or FetchError naming `url`."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise FetchError(f"{url}: not JSON ({type(exc).__name__})") from exc


async def fetch_json(
    session: aiohttp.ClientSession, url: str, *, max_bytes: int, deadline_s: float = DEADLINE_S
) -> Any:
    """The parsed JSON at `url`, or FetchError (not up, an error status, too big, too slow)."""
    body = await fetch_bytes(session, url, max_bytes=max_bytes, deadline_s=deadline_s)
    return parse_json(url, body)


def session(timeout: float, connections: int) -> aiohttp.ClientSession:
    """No proxies from the environment, no decompression, `connections` sockets at most."""
    return aiohttp.ClientSession(
        auto_decompress=False,
        trust_env=False,
        timeout=aiohttp.ClientTimeout(total=timeout),
        connector=aiohttp.TCPConnector(limit=connections),
    )
