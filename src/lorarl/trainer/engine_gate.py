"""Which engines may generate: those whose sidecar says they serve the newest weights.

An engine that restarted serves base weights until its sidecar re-applies the latest version; a
sample from it would be off-policy and mislabelled. The sidecar's /healthz is 200 only when its
engine is up and in sync, so the trainer asks before every step (cheap: one GET per replica).
"""

from __future__ import annotations

import logging
import time

import httpx

log = logging.getLogger(__name__)


class NoEngineReady(RuntimeError):
    pass


def synced_engines(engines: list[str], sidecars: list[str], http: httpx.Client) -> set[str]:
    ready = set()
    for engine, sidecar in zip(engines, sidecars, strict=True):
        try:
            if http.get(f"{sidecar}/healthz").status_code == 200:
                ready.add(engine)
        except httpx.HTTPError:
            continue  # sidecar unreachable (pod restarting): not ready this step
    return ready


def wait_for_synced_engines(
    engines: list[str],
    sidecars: list[str],
    http: httpx.Client,
    timeout_s: float = 900.0,
    poll_s: float = 1.0,
) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        ready = synced_engines(engines, sidecars, http)
        if ready:
            if len(ready) < len(engines):
                log.warning("generating on %d of %d engines (others catching up)",
                            len(ready), len(engines))  # fmt: skip
            return ready
        if time.monotonic() > deadline:
            raise NoEngineReady(
                f"no rollout engine served the current weights within {timeout_s:.0f} s "
                f"(sidecars: {', '.join(sidecars)})"
            )
        time.sleep(poll_s)
