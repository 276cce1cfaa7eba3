"""The one interface both job stores implement, and the errors the app maps to HTTP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from lorarl.server.models import JobDetail, JobMetrics, JobSamples, JobSummary


class JobNotFound(LookupError):
    def __init__(self, namespace: str, name: str) -> None:
        super().__init__(f"LoRARLJob {namespace}/{name} not found")
        self.namespace = namespace
        self.name = name


class StoreUnavailable(RuntimeError):
    """The backing system (the Kubernetes API) could not answer; the app turns it into a 503."""


class JobStore(Protocol):
    def list_jobs(self, namespaces: Sequence[str] | None = None) -> list[JobSummary]:
        """Jobs in these namespaces (all namespaces when None), sorted by namespace and name."""
        ...

    def get_job(self, namespace: str, name: str) -> JobDetail:
        """Raises JobNotFound."""
        ...

    def get_metrics(self, namespace: str, name: str) -> JobMetrics:
        """The step history; empty with a `detail` when the trainer cannot be reached."""
        ...

    def get_samples(self, namespace: str, name: str) -> JobSamples:
        """The newest sample completions; empty with a `detail` when they cannot be read."""
        ...
