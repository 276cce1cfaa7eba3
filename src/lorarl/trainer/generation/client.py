"""The trainer's client for the rollout replicas: n samples per prompt, with ids, logprobs, version.

Load is balanced by least outstanding requests (ties round-robin), so a slow replica gets fewer
prompts. A failed endpoint is put in a cooldown that doubles with each consecutive failure: without
it a dead replica, which fails instantly and so always looks least loaded, would attract every
request. Connect errors, timeouts, 429 and 5xx are retried on another endpoint; other 4xx and
unparseable answers are bugs, raised at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from lorarl.engines import sglang, vllm
from lorarl.trainer.generation.calls import (
    describe,
    normalize_url,
    run_sync,
    seeded,
    snippet,
)
from lorarl.trainer.generation.endpoint_pick import EndpointState, RolloutError, pick_endpoint
from lorarl.trainer.generation.liveness import (
    PROBE_INTERVAL_S,
    PROBE_MISSES,
    PROBE_TIMEOUT_S,
    Liveness,
    ReplicaVanished,
    unless_gone,
)
from lorarl.trainer.generation.types import (
    ENGINES,
    Sample,
    SamplingParams,
    WireFormatError,
    check_prompts,
)
from lorarl.trainer.generation.wire import (
    build_sglang_generate_request,
    build_vllm_completion_request,
    parse_sglang_generate_response,
    parse_vllm_completion_response,
)

__all__ = ["RolloutClient", "RolloutError", "Sample", "SamplingParams", "pick_endpoint"]

_MAX_COOLDOWN_S = 30.0
CONNECT_TIMEOUT_S = 5.0


class RolloutClient:
    """Asks the rollout engines (vLLM or SGLang HTTP servers) for samples.

    Use `async with RolloutClient(...) as c: await c.agenerate(...)` from async code (one pooled
    HTTP client), or the sync `generate`/`health`/`wait_ready` from the trainer loop.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        engine: str,
        *,
        model_name: str,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_concurrency_per_endpoint: int = 16,
        probe_interval_s: float = PROBE_INTERVAL_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        probe_misses: int = PROBE_MISSES,
    ) -> None:
        if isinstance(endpoints, str) or not endpoints:
            raise ValueError("endpoints must be a non-empty list of base URLs (http://host:port)")
        urls = [normalize_url(u) for u in endpoints]
        if len(set(urls)) != len(urls):
            raise ValueError(f"endpoints contain duplicates: {urls}")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        if not model_name:
            raise ValueError("model_name must be the engine's served model name")
        for name, value in (("timeout_s", timeout_s), ("backoff_s", backoff_s)):
            if (
                not isinstance(value, (int, float))
                or value < 0
                or (name == "timeout_s" and value == 0)
            ):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        if not isinstance(max_concurrency_per_endpoint, int) or max_concurrency_per_endpoint < 1:
            raise ValueError(
                "max_concurrency_per_endpoint must be an integer >= 1, "
                f"got {max_concurrency_per_endpoint!r}"
            )
        self.engine = engine
        self.model_name = model_name
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.max_concurrency = max_concurrency_per_endpoint
        # A replica with requests in flight is probed: silence moves them elsewhere (liveness.py)
        self._liveness = functools.partial(
            Liveness,
            interval_s=probe_interval_s,
            timeout_s=probe_timeout_s,
            misses=probe_misses,
        )
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._states = [EndpointState(u) for u in urls]
        self._rr = 0
        self._http: httpx.AsyncClient | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None
        self._sems: list[asyncio.Semaphore] = []

    @property
    def endpoints(self) -> list[str]:
        return [s.url for s in self._states]

    def set_serving(self, urls: set[str]) -> None:
        """Route requests only to these endpoints (e.g. the engines on the latest weights)."""
        unknown = urls - {s.url for s in self._states}
        if unknown:
            raise ValueError(f"unknown endpoints {sorted(unknown)}")
        for state in self._states:
            state.serving = state.url in urls

    def set_endpoints(self, urls: Sequence[str]) -> None:
        """Route requests to exactly these endpoints from now on (the live replicas on the
        latest weights). New ones are added; dropped ones are kept, not serving, with their
        counts, and serve again (cooldown cleared) if they come back."""
        wanted = [normalize_url(u) for u in urls]
        known = {s.url: s for s in self._states}
        for url in wanted:
            if url not in known:
                state = EndpointState(url)
                self._states.append(state)
                known[url] = state
            elif not known[url].serving:
                known[url].consecutive_failures, known[url].cooldown_until = 0, 0.0
        for state in self._states:
            state.serving = state.url in wanted

    def requests_by_endpoint(self) -> dict[str, int]:
        """Requests sent so far to each endpoint ever used (retries on another one count
        there)."""
        return {s.url: s.requests for s in self._states}

    def endpoint_stats(self) -> dict[str, dict[str, int]]:
        """Requests sent and failures seen per endpoint (for metrics)."""
        return {
            s.url: {"requests": s.requests, "failures": s.failures, "outstanding": s.outstanding}
            for s in self._states
        }

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> RolloutClient:
        self._http = self._new_http()
        return self

    async def __aexit__(self, *exc: object) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.aclose()

    def _new_http(self) -> httpx.AsyncClient:
        conns = self.max_concurrency * len(self._states) + len(self._states)
        return httpx.AsyncClient(
            headers=self._headers,
            # A replica that vanished (pod deleted, node gone) drops SYNs without a reset: a
            # connect must fail in seconds so the request moves on, while a long generation may
            # take the whole timeout.
            timeout=httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, CONNECT_TIMEOUT_S)),
            limits=httpx.Limits(max_connections=conns, max_keepalive_connections=conns),
        )

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[httpx.AsyncClient]:
        if self._http is not None:
            yield self._http
        else:
            async with self._new_http() as http:
                yield http

    def _semaphores(self) -> list[asyncio.Semaphore]:
        # asyncio primitives bind to one loop; the sync wrappers run a fresh loop per call.
        loop = asyncio.get_running_loop()
        if self._sem_loop is not loop:
            self._sem_loop, self._sems = loop, []
        while len(self._sems) < len(self._states):  # endpoints added by set_endpoints
            self._sems.append(asyncio.Semaphore(self.max_concurrency))
        return self._sems

    # ------------------------------------------------------------------ generation

    async def agenerate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        *,
        model: str | None = None,
        expected_version: int,
    ) -> list[list[Sample]]:
        """n samples for each tokenized prompt, in prompt order.

        `model` is the served name to sample from (default `model_name`; in adapter mode the
        versioned adapter `<name>-v<N>`). `expected_version` is the weight version the trainer
        last synced and every replica acknowledged; a sample carries the engine-reported version
        when the engine reports one (SGLang `weight_version`, a versioned adapter name), else
        this one.
        """
        batch = check_prompts(prompts)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        if (
            isinstance(expected_version, bool)
            or not isinstance(expected_version, int)
            or expected_version < 0
        ):
            raise ValueError(f"expected_version must be an integer >= 0, got {expected_version!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        target = model or self.model_name
        async with self._session() as http:
            liveness = self._liveness(http)
            calls = [
                self._sample_prompt(
                    http, liveness, prompt, n, seeded(params, i, n), target, expected_version
                )
                for i, prompt in enumerate(batch)
            ]
            try:
                return list(await asyncio.gather(*calls))
            finally:
                await liveness.close()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        *,
        model: str | None = None,
        expected_version: int,
    ) -> list[list[Sample]]:
        """Sync `agenerate` for the trainer loop."""
        return run_sync(
            self.agenerate(prompts, n, params, model=model, expected_version=expected_version)
        )

    def _request(
        self, prompt: list[int], n: int, params: SamplingParams, model: str
    ) -> tuple[str, dict[str, Any]]:
        if self.engine == "vllm":
            return vllm.COMPLETIONS, build_vllm_completion_request(prompt, n, params, model=model)
        lora = None if model == self.model_name else model
        return sglang.GENERATE, build_sglang_generate_request(prompt, n, params, lora_name=lora)

    def _parse(
        self,
        body: object,
        prompt: list[int],
        n: int,
        model: str,
        endpoint: str,
        expected_version: int,
    ) -> list[Sample]:
        if self.engine == "vllm":
            return parse_vllm_completion_response(
                body, prompt_ids=prompt, n=n, endpoint=endpoint, expected_version=expected_version
            )
        lora = None if model == self.model_name else model
        return parse_sglang_generate_response(
            body,
            prompt_ids=prompt,
            n=n,
            endpoint=endpoint,
            expected_version=expected_version,
            lora_name=lora,
        )

    async def _sample_prompt(
        self,
        http: httpx.AsyncClient,
        liveness: Liveness,
        prompt: list[int],
        n: int,
        params: SamplingParams,
        model: str,
        expected_version: int,
    ) -> list[Sample]:
        path, payload = self._request(prompt, n, params, model)
        sems = self._semaphores()
        tried: set[int] = set()
        used: list[str] = []
        last_error = ""
        for _attempt in range(self.max_retries + 1):
            if tried >= {i for i, st in enumerate(self._states) if st.serving}:
                tried.clear()
            i = pick_endpoint(self._states, tried=tried, now=time.monotonic(), rr=self._rr)
            self._rr = i + 1
            tried.add(i)
            state = self._states[i]
            if state.url not in used:
                used.append(state.url)
            state.outstanding += 1  # before any await, so concurrent picks see it
            try:
                wait = state.cooldown_until - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                async with sems[i], liveness.watching(state.url) as gone:
                    state.requests += 1
                    response = await unless_gone(
                        http.post(state.url + path, json=payload), gone, self.timeout_s
                    )
            except (httpx.TransportError, asyncio.TimeoutError, ReplicaVanished) as exc:
                last_error = f"{state.url}: {describe(exc, self.timeout_s)}"
                self._failed(state)
                continue
            finally:
                state.outstanding -= 1
            if response.status_code == 429 or response.status_code >= 500:
                last_error = f"{state.url}: HTTP {response.status_code}: {snippet(response)}"
                self._failed(state)
                continue
            if response.status_code != 200:
                raise RolloutError(
                    f"{state.url} rejected the {self.engine} request: HTTP "
                    f"{response.status_code}: {snippet(response)}",
                    endpoints=[state.url],
                    last_error=snippet(response),
                )
            self._succeeded(state)
            try:
                return self._parse(response.json(), prompt, n, model, state.url, expected_version)
            except (WireFormatError, ValueError) as exc:
                raise RolloutError(
                    f"bad {self.engine} response from {state.url}: {exc}",
                    endpoints=[state.url],
                    last_error=str(exc),
                ) from exc
        raise RolloutError(
            f"rollout request failed after {self.max_retries + 1} attempt(s) on "
            f"{', '.join(used)}; last error: {last_error}",
            endpoints=used,
            last_error=last_error,
        )

    def _failed(self, state: EndpointState) -> None:
        state.failures += 1
        state.consecutive_failures += 1
        delay = min(self.backoff_s * 2 ** (state.consecutive_failures - 1), _MAX_COOLDOWN_S)
        state.cooldown_until = time.monotonic() + delay

    @staticmethod
    def _succeeded(state: EndpointState) -> None:
        state.consecutive_failures = 0
        state.cooldown_until = 0.0

    # ------------------------------------------------------------------ health

    async def ahealth(self) -> dict[str, bool]:
        """`GET /health` on every endpoint (same path on vLLM and SGLang): True when 200."""
        async with self._session() as http:

            async def probe(url: str) -> bool:
                try:
                    r = await http.get(url + vllm.HEALTH, timeout=min(self.timeout_s, 5.0))
                except httpx.TransportError:
                    return False
                return r.status_code == 200

            results = await asyncio.gather(*(probe(s.url) for s in self._states))
        return dict(zip(self.endpoints, results, strict=True))

    def health(self) -> dict[str, bool]:
        return run_sync(self.ahealth())

    async def await_ready(
        self, timeout_s: float, *, require_all: bool = True, poll_s: float = 0.25
    ) -> None:
        """Poll health until every endpoint (or, with require_all=False, any) answers 200."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = await self.ahealth()
            if (all if require_all else any)(status.values()):
                return
            if time.monotonic() >= deadline:
                down = [u for u, ok in status.items() if not ok]
                raise RolloutError(
                    f"rollout endpoints not ready after {timeout_s:g}s: {', '.join(down)}",
                    endpoints=down,
                    last_error="health check failed",
                )
            await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    def wait_ready(
        self, timeout_s: float, *, require_all: bool = True, poll_s: float = 0.25
    ) -> None:
        run_sync(self.await_ready(timeout_s, require_all=require_all, poll_s=poll_s))
