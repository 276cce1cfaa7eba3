"""LoRARLJobs read from the Kubernetes API; step history proxied from each job's trainer.

The status comes from the object (the operator writes it); the history only the trainer has, at
`http://<job>-trainer-0.<job>.<namespace>.svc:8080/progress/history` (the headless Service gives
rank 0 that name). An unreachable trainer yields an empty history with a `detail`, not an error:
a pending or finished job simply has no trainer to ask.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from lorarl.api.reports.status import LoRARLJobStatus
from lorarl.api.resource import GROUP, PLURAL, VERSION, LoRARLJob
from lorarl.server import views
from lorarl.server.kube_api import KubeApi, KubeApiError, segment
from lorarl.server.models import JobDetail, JobMetrics, JobSamples, JobSummary, SpecSummary
from lorarl.server.names import name_problem, namespace_problem
from lorarl.server.stores.base import JobNotFound, StoreUnavailable
from lorarl.server.stores.progress_client import ProgressClient, TrainerUnreachable

DEFAULT_PROGRESS_URL = "http://{name}-trainer-0.{name}.{namespace}.svc:8080"
_BASE = f"/apis/{GROUP}/{VERSION}"


def jobs_path(namespace: str | None = None, name: str | None = None) -> str:
    if namespace is None:
        return f"{_BASE}/{PLURAL}"
    path = f"{_BASE}/namespaces/{segment(namespace)}/{PLURAL}"
    return f"{path}/{segment(name)}" if name is not None else path


@dataclass(frozen=True)
class _Parsed:
    namespace: str
    name: str
    spec: SpecSummary | None
    status: LoRARLJobStatus
    created: float | None
    detail: str | None


def _parse(obj: dict) -> _Parsed:
    """Tolerant: an object that no longer matches the models (an older or newer lorarl wrote it)
    still lists, with a detail instead of a spec."""
    meta = obj.get("metadata") or {}
    namespace, name = meta.get("namespace") or "default", meta.get("name") or ""
    created = views.parse_rfc3339(meta.get("creationTimestamp"))
    try:
        job = LoRARLJob.model_validate(obj)
    except ValidationError as exc:
        try:
            status = LoRARLJobStatus.model_validate(obj.get("status") or {})
        except ValidationError:
            status = LoRARLJobStatus()
        detail = f"LoRARLJob {namespace}/{name} does not match this server's API models: {exc}"
        return _Parsed(namespace, name, None, status, created, detail)
    status = job.status or LoRARLJobStatus()
    return _Parsed(namespace, name, views.spec_summary(job), status, created, None)


class KubeStore:
    def __init__(
        self,
        api: KubeApi,
        *,
        progress_url: str = DEFAULT_PROGRESS_URL,
        namespace: str | None = None,
        client: ProgressClient | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`progress_url`: a template with `{name}` and `{namespace}` (tests aim it at loopback).
        `namespace`: serve only this namespace (a single-namespace install, whose service account
        may read nothing else); None serves all."""
        self._api = api
        self._namespace = namespace or None
        self._progress_url = progress_url
        self._client = client or ProgressClient(timeout=2.0)
        self._clock = clock

    def _get(self, path: str, namespace: str = "", name: str = "") -> dict:
        try:
            return self._api.get(path)
        except KubeApiError as exc:
            if exc.status == 404 and name:
                raise JobNotFound(namespace, name) from exc
            raise StoreUnavailable(f"reading LoRARLJobs from the Kubernetes API: {exc}") from exc

    def list_jobs(self, namespaces: Sequence[str] | None = None) -> list[JobSummary]:
        if self._namespace is not None:
            namespaces = [ns for ns in namespaces or [self._namespace] if ns == self._namespace]
        if namespaces is None:
            items = self._get(jobs_path()).get("items") or []
        else:  # a namespace that cannot exist has no jobs; never put it in a URL
            valid = [ns for ns in namespaces if namespace_problem(ns) is None]
            items = [i for ns in valid for i in self._get(jobs_path(ns)).get("items") or []]
        now = self._clock()
        rows = [
            views.job_summary(p.namespace, p.name, p.status, p.created, now)
            for p in map(_parse, items)
        ]
        return sorted(rows, key=lambda r: (r.namespace, r.name))

    def _read_job(self, namespace: str, name: str) -> dict:
        if self._namespace is not None and namespace != self._namespace:
            raise JobNotFound(namespace, name)
        if namespace_problem(namespace) or name_problem(name):  # cannot exist: not a URL
            raise JobNotFound(namespace, name)
        return self._get(jobs_path(namespace, name), namespace, name)

    def get_job(self, namespace: str, name: str) -> JobDetail:
        parsed = _parse(self._read_job(namespace, name))
        return JobDetail(
            namespace=parsed.namespace,
            name=parsed.name,
            source="kubernetes",
            spec=parsed.spec,
            status=parsed.status,
            conditions=parsed.status.conditions,
            live=False,
            detail=parsed.detail,
        )

    def progress_url(self, namespace: str, name: str) -> str:
        return self._progress_url.format(name=name, namespace=namespace)

    def get_metrics(self, namespace: str, name: str) -> JobMetrics:
        self._read_job(namespace, name)  # 404 for a job that is not there
        url = self.progress_url(namespace, name)
        try:
            history = self._client.history(url)
        except TrainerUnreachable as exc:
            return JobMetrics(
                namespace=namespace,
                name=name,
                steps=[],
                live=False,
                detail=f"no step history: the trainer's progress endpoint did not answer ({exc})",
            )
        return JobMetrics(
            namespace=namespace, name=name, steps=views.dedupe_steps(history), live=True
        )

    def get_samples(self, namespace: str, name: str) -> JobSamples:
        """From the trainer while it runs; afterwards they are in samples.jsonl on the volume."""
        self._read_job(namespace, name)  # 404 for a job that is not there
        try:
            samples = self._client.samples(self.progress_url(namespace, name))
        except TrainerUnreachable as exc:
            why = (
                f"no samples: the trainer's progress endpoint did not answer ({exc}); they are "
                "in samples.jsonl in training.outputDir"
            )
            return JobSamples(namespace=namespace, name=name, samples=[], live=False, detail=why)
        return JobSamples(namespace=namespace, name=name, samples=samples, live=True)
