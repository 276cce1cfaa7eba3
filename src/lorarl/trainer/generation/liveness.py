"""In-flight requests and replicas that vanish: a generation request already sent to a replica
whose pod is deleted or whose node is gone gets no reset, only silence, and would hold its
prompt for the whole request timeout (minutes) while the other replicas idle.

So while a replica has requests in flight, `Liveness` asks it `GET /health` every few seconds;
after `misses` probes in a row without an answer (any HTTP status is an answer: the process is
there) the replica's event is set and the requests waiting on it give up and go elsewhere
(`RolloutClient`, docs/architecture.md#live-membership). A slow but present replica keeps
answering its probes and keeps its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import httpx

from lorarl.engines.vllm import HEALTH  # SGLang serves the same path (lorarl.engines.sglang)

T = TypeVar("T")
PROBE_INTERVAL_S = 2.0
PROBE_TIMEOUT_S = 5.0
PROBE_MISSES = 3  # ~20 s from the last answer to giving up, against request timeouts of minutes


class ReplicaVanished(Exception):
    """The replica stopped answering its health probes while a request waited on it."""


class Liveness:
    """Per event loop (asyncio events bind to one): one probe task per replica in use."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        interval_s: float = PROBE_INTERVAL_S,
        timeout_s: float = PROBE_TIMEOUT_S,
        misses: int = PROBE_MISSES,
    ) -> None:
        self._http, self.interval_s, self.timeout_s, self.misses = (
            http,
            interval_s,
            timeout_s,
            misses,
        )
        self._users: dict[str, int] = {}
        self._gone: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @contextlib.asynccontextmanager
    async def watching(self, url: str) -> AsyncIterator[asyncio.Event]:
        """The replica's vanished-event, probed while at least one caller is inside."""
        if not self._users.get(url):
            self._gone[url] = asyncio.Event()
            self._tasks[url] = asyncio.create_task(self._probe(url, self._gone[url]))
        self._users[url] = self._users.get(url, 0) + 1
        try:
            yield self._gone[url]
        finally:
            self._users[url] -= 1
            if not self._users[url]:
                self._tasks.pop(url).cancel()

    async def _probe(self, url: str, gone: asyncio.Event) -> None:
        missed = 0
        while missed < self.misses:
            await asyncio.sleep(self.interval_s)
            try:
                await self._http.get(url + HEALTH, timeout=self.timeout_s)
                missed = 0
            except httpx.TransportError:  # timeouts included: silence is what a vanished one gives
                missed += 1
        gone.set()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def unless_gone(call: Awaitable[T], gone: asyncio.Event, timeout_s: float) -> T:
    """`call`'s result; asyncio.TimeoutError after `timeout_s`; ReplicaVanished (and `call`
    cancelled) as soon as `gone` is set."""
    task = asyncio.ensure_future(call)
    waiter = asyncio.ensure_future(gone.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if task in done:
            return task.result()
        if waiter in done:
            raise ReplicaVanished
        raise asyncio.TimeoutError
    finally:
        for pending in (task, waiter):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, waiter, return_exceptions=True)
