"""Pods: an index of each job's pods, and a pass whenever one changes (failures, deletions,
phases). Nothing here writes to pods but create/delete: the RBAC grants no patch."""

from __future__ import annotations

from typing import Any

import kopf

from lorarl.operator.builders import JOB_LABEL
from lorarl.operator.handlers.common import POD_LABELS, JobPods, pods_of, reconciler
from lorarl.operator.kube import KubeError
from lorarl.operator.status import PodView, pod_view


@kopf.index("", "v1", "pods", labels=POD_LABELS)
async def job_pods(
    body: kopf.Body, namespace: str | None, **_: Any
) -> dict[tuple[str, str], PodView] | None:
    """Async, as every handler here: kopf runs a sync one in its thread pool, and the handoff
    cost more than the work (a fifth of the operator's CPU with 200 jobs' pods arriving)."""
    view = pod_view(body)
    if view is None:
        return None
    return {(namespace or "default", view.job): view}  # the key `common.run` looks up


@kopf.on.event("", "v1", "pods", labels=POD_LABELS)
async def pod_changed(
    namespace: str | None,
    labels: kopf.Labels,
    memo: kopf.Memo,
    logger: kopf.Logger,
    type: str | None = None,  # kopf's name for the watch event type
    body: kopf.Body | None = None,
    job_pods: JobPods | None = None,
    **_: Any,
) -> None:
    job, namespace = labels[JOB_LABEL], namespace or "default"
    if type == "DELETED" and body is not None:  # a preemption unless the operator deleted it
        view = pod_view(body)
        if view is not None:
            reconciler(memo).pod_gone(namespace, job, view)
    try:
        await reconciler(memo).poke(namespace, job, pods_of(job_pods, namespace, job), "pod")
    except KubeError as exc:  # events are not retried; the timer's next pass is
        logger.warning("reconciling %s/%s after a pod event failed: %s", namespace, job, exc)
