"""Outliving the CRD. kopf's watch of LoRARLJobs fails with a 404 once the CRD is deleted (an
uninstall, an upgrade that replaces it) and kopf then ends; scanning, which would notice, needs
CRD reads the chart does not grant. So `__main__` catches that end, waits here until the API
server serves LoRARLJobs again (answering /healthz meanwhile, so a liveness probe does not
restart a pod that is only waiting), and starts kopf again."""

from __future__ import annotations

import asyncio
import logging

from lorarl.api.resource import GROUP, PLURAL, VERSION
from lorarl.operator.kube import Kube, KubeError, load_credentials
from lorarl.operator.metrics import health_route, serve

log = logging.getLogger(__name__)
POLL_SECONDS = 2.0


def is_resource_gone(exc: BaseException) -> bool:
    """kopf's end by a 404 on its watch: the watched resource is not served (kopf's error class
    is private, so it is recognised by name and status)."""
    return type(exc).__name__ == "APINotFoundError" or getattr(exc, "status", None) == 404


async def served(kube: Kube) -> bool:
    """True once discovery lists LoRARLJobs in our group/version."""
    try:
        body = await kube.get(f"/apis/{GROUP}/{VERSION}")
    except KubeError as exc:
        log.debug("discovery of %s/%s: %s", GROUP, VERSION, exc)
        return False
    return any(r.get("name") == PLURAL for r in (body or {}).get("resources", []))


async def wait_until_served(health_port: int, poll: float = POLL_SECONDS) -> None:
    kube = Kube(load_credentials())
    runner = (
        await serve({"/healthz": health_route()}, "0.0.0.0", health_port) if health_port else None
    )
    try:
        log.warning("%s.%s is not served (the CRD was deleted?): waiting for it", PLURAL, GROUP)
        while not await served(kube):
            await asyncio.sleep(poll)
        log.warning("%s.%s is served again: starting the handlers", PLURAL, GROUP)
    finally:
        if runner is not None:
            await runner.cleanup()
        await kube.close()
