"""Prometheus metrics (jobs by phase, reconcile latency, trainer restarts) and the small HTTP
servers for `/metrics` and `/healthz`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import aiohttp.web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PHASES = ("Pending", "Starting", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
# The operator's view of its jobs: (namespace, name) -> phase (`Reconciler.phases`).
Phases = Callable[[], Mapping[tuple[str, str], str | None]]


class _JobsByPhase:
    """Counted at scrape time from the operator's view, so deleted jobs never linger."""

    def __init__(self, phases: Phases) -> None:
        self._phases = phases

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("lorarl_jobs", "LoRARLJobs by phase.", labels=["phase"])
        counts = dict.fromkeys(PHASES, 0)
        for phase in self._phases().values():
            if phase in counts:
                counts[phase] += 1
        for phase, n in counts.items():
            family.add_metric([phase], n)
        yield family


class OperatorMetrics:
    def __init__(self, phases: Phases) -> None:
        self.registry = CollectorRegistry()
        self.reconcile_seconds = Histogram(
            "lorarl_reconcile_seconds",
            "Time of one reconcile pass of a job.",
            ["trigger"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.restarts = Counter(
            "lorarl_trainer_restarts",
            "Trainer group restarts.",
            ["namespace"],
            registry=self.registry,
        )
        self.reconcile_errors = Counter(
            "lorarl_reconcile_errors",
            "Reconcile passes that failed (retried).",
            ["trigger"],
            registry=self.registry,
        )
        self.registry.register(_JobsByPhase(phases))

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve(
    routes: Mapping[str, Callable[[], tuple[bytes, str]]], host: str, port: int
) -> aiohttp.web.AppRunner:
    """One tiny aiohttp app per port; each route returns (body, content type)."""
    app = aiohttp.web.Application()
    for route, render in routes.items():

        async def handle(_: aiohttp.web.Request, render=render) -> aiohttp.web.Response:
            body, ctype = render()
            return aiohttp.web.Response(body=body, headers={"Content-Type": ctype})

        app.router.add_get(route, handle)
    runner = aiohttp.web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, host, port).start()
    return runner


def metrics_route(metrics: OperatorMetrics) -> Callable[[], tuple[bytes, str]]:
    return lambda: (metrics.render(), CONTENT_TYPE_LATEST)


def health_route() -> Callable[[], tuple[bytes, str]]:
    return lambda: (b"ok\n", "text/plain")
