"""Prometheus metrics of the status API: requests by route and status, jobs by phase.

Each app gets its own registry, so two apps in one process (tests) never collide and `/metrics`
shows only this server. Jobs by phase are counted at scrape time from the store: aggregate counts
with no names, read with the server's own credentials.
"""

from __future__ import annotations

import logging
from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lorarl.server.stores.base import JobStore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
log = logging.getLogger(__name__)


class _JobsCollector(Collector):
    def __init__(self, store: JobStore) -> None:
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("lorarl_server_store_up", "1 if the job store answered the scrape.")
        jobs = GaugeMetricFamily("lorarl_server_jobs", "LoRARLJobs by phase.", labels=["phase"])
        try:
            rows = self._store.list_jobs(None)
        except Exception as exc:  # a scrape must not fail because the store did
            log.warning("jobs-by-phase scrape failed: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        for phase, count in sorted(Tally(r.phase or "Unknown" for r in rows).items()):
            jobs.add_metric([phase], count)
        yield up
        yield jobs


class Telemetry:
    def __init__(self, store: JobStore) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "lorarl_server_requests",
            "HTTP requests by route template, method and status code.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "lorarl_server_request_seconds",
            "HTTP request latency by route template.",
            ["route"],
            registry=self.registry,
        )
        self.registry.register(_JobsCollector(store))

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
