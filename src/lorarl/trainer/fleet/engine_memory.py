"""Colocated GPU engines lend their memory to each update (docs/architecture.md#placement).

Colocated on GPUs, an engine shares its trainer pod's devices, so generation and the update take
turns. Rank 0 releases every live engine once the step's rollouts are generated and scored,
before the batch broadcast lets any rank start its update, and resumes them once every rank has
finished it, before the weight sync: the sidecars write the new weights into awake engines.
Engines start awake, so a new or resumed job's first step is like any other. The routes (vLLM's
dev-mode sleep API, SGLang's memory occupation API) are pinned by tests/contract.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import torch
import torch.distributed as dist

from lorarl.api.spec.placement import releases_engine_memory
from lorarl.engines import sglang, vllm

log = logging.getLogger(__name__)

# Retries are for a call that failed in transit (a connection reset, a timeout). The release is
# sent only once the step's requests are all answered: SGLang asserts that its scheduler is idle
# and a release during a request would kill it, not be refused.
ATTEMPTS = 3
RETRY_S = 1.0
CALL_TIMEOUT_S = 300.0  # moving a large model's weights to CPU and back takes a while


class EngineEndpoints(Protocol):
    """What `EngineMemory.for_job` reads of the trainer's `settings.Endpoints` (the settings sit
    above the fleet: docs/architecture.md, Layers)."""

    @property
    def rollout(self) -> list[str]: ...

    @property
    def engine_api_key(self) -> str | None: ...


class EngineMemoryError(RuntimeError):
    """A live engine kept its memory (the update would run out) or stayed asleep."""


@dataclass(frozen=True)
class EngineCall:
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    body: dict[str, Any] | None = None  # SGLang parses a JSON body; vLLM takes none


# engine -> (release, resume); pinned to each engine's routes by tests/contract.
CALLS: dict[str, tuple[EngineCall, EngineCall]] = {
    "vllm": (EngineCall(vllm.SLEEP, {"level": 1}), EngineCall(vllm.WAKE_UP)),
    "sglang": (
        EngineCall(sglang.RELEASE_MEMORY_OCCUPATION, body={}),  # no tags: all of them
        EngineCall(sglang.RESUME_MEMORY_OCCUPATION, body={}),
    ),
}


def live_engine_urls(fleet: Any, fallback: Sequence[str]) -> list[str]:
    """Engines of the replicas whose sidecar answers now (the fleet's view), else the env's."""
    return list(fallback) if fleet is None else [m.engine for m, _ in fleet.live() if m.engine]


class EngineMemory:
    """Rank 0's release/resume of the engines' memory; a no-op unless `enabled`
    (lorarl.api.spec.placement.releases_engine_memory)."""

    def __init__(
        self, enabled: bool, engine: str, http: httpx.Client | None, api_key: str | None,
        live: Callable[[], Sequence[str]], *, attempts: int = ATTEMPTS, retry_s: float = RETRY_S,
        timeout_s: float = CALL_TIMEOUT_S, sleep: Callable[[float], None] = time.sleep,
    ) -> None:  # fmt: skip
        self.enabled, self.http, self.live = enabled, http, live
        self.release_call, self.resume_call = CALLS[engine]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.attempts, self.retry_s, self.timeout_s = attempts, retry_s, timeout_s
        self._sleep = sleep
        self.released: list[str] = []  # engines asleep now, by us: the only ones resumed

    @classmethod
    def for_job(
        cls, spec: Any, http: httpx.Client, endpoints: EngineEndpoints, fleet: Callable[[], Any]
    ) -> EngineMemory:
        """The trainer's: the engines of `fleet()`'s live replicas, else those in the env."""
        live = lambda: live_engine_urls(fleet(), endpoints.rollout)  # noqa: E731
        on = releases_engine_memory(spec)
        return cls(on, spec.rollout.engine, http, endpoints.engine_api_key, live)

    def release(self) -> None:
        """After the step's generation (rollouts and rewards in), before any rank's update."""
        if self.enabled:
            urls = [u for u in self.live() if u not in self.released]
            self._call_all(self.release_call, urls, "release", self.released)

    def resume(self) -> None:
        """Before the weight sync and the next generation; nothing to do if none is released."""
        urls, self.released = self.released, []
        if urls:
            self._call_all(self.resume_call, urls, "resume", [])

    def after_update(self, is_main: bool) -> None:
        """Every rank, after its update: cached blocks go back to the device and the ranks
        meet, so no engine wakes into memory a rank still uses; then rank 0 resumes them."""
        if not self.enabled:
            return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if dist.is_initialized():
            dist.barrier()
        if is_main:
            self.resume()

    def _post(self, url: str, call: EngineCall) -> str | None:
        """None when the engine did it, else why not."""
        if self.http is None:  # only a disabled EngineMemory may lack a client: it never posts
            raise RuntimeError("EngineMemory is enabled without an HTTP client")
        try:
            reply = self.http.post(
                url + call.path, params=call.params, json=call.body, headers=self.headers,
                timeout=self.timeout_s,
            )  # fmt: skip
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if not reply.is_success:
            return f"HTTP {reply.status_code}: {reply.text[:300]}"
        if call.path == vllm.WAKE_UP and '"awake"' not in reply.text:  # vLLM: else "sleeping"
            return f"not fully awake after wake_up: {reply.text[:300]}"
        return None

    def _call_all(self, call: EngineCall, urls: list[str], what: str, done: list[str]) -> None:
        """`call` on every engine at once, the failed ones retried while they are live; each
        that did it is appended to `done`. Raises if a live one never did."""
        pending, errors = list(urls), {}
        for attempt in range(self.attempts if pending else 0):
            with ThreadPoolExecutor(len(pending)) as pool:
                results = pool.map(lambda u: self._post(u, call), pending)
                outcome = dict(zip(pending, results, strict=True))
            done += [u for u, err in outcome.items() if err is None]
            errors = {u: err for u, err in outcome.items() if err is not None}
            if errors:
                live = set(self.live())
                for url in [u for u in errors if u not in live]:
                    log.warning("engine %s left the fleet; skipped its %s", url, what)
                    del errors[url]
            pending = list(errors)
            if not pending:
                break
            if attempt + 1 < self.attempts:
                log.warning("%s of engine memory failed, retrying: %s", what, errors)
                self._sleep(self.retry_s * 2**attempt)
        if errors:
            detail = "; ".join(f"{u}: {e}" for u, e in errors.items())
            raise EngineMemoryError(f"{what} of GPU memory failed {self.attempts} times: {detail}")
