"""What every handler shares: the watched resource, the settings, and one way to run a pass."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from lorarl.api.resource import GROUP, PLURAL, VERSION
from lorarl.operator.builders import JOB_LABEL, MANAGED_BY
from lorarl.operator.config import OperatorConfig
from lorarl.operator.kube import KubeError
from lorarl.operator.reconciler import Reconciler
from lorarl.operator.status import PodView

JOBS = (GROUP, VERSION, PLURAL)
POD_LABELS = {JOB_LABEL: kopf.PRESENT, MANAGED_BY[0]: MANAGED_BY[1]}
CONFIG = OperatorConfig.from_env()
RETRY_SECONDS = 2.0


def reconciler(memo: Any) -> Reconciler:
    return memo["reconciler"]


def pods_of(index: Any, namespace: str, name: str) -> list[PodView]:
    """The job's pods from the pod index (kopf keeps it current from the pod watch)."""
    store = index.get((namespace, name)) if index is not None else None
    return list(store) if store is not None else []


async def run(
    memo: Any, body: Mapping[str, Any], index: Any, trigger: str, poll: bool = False
) -> None:
    meta = body["metadata"]
    pods = pods_of(index, meta.get("namespace") or "default", meta["name"])
    try:
        await reconciler(memo).reconcile(body, pods, trigger=trigger, poll=poll)
    except KubeError as exc:  # the API server said no or did not answer: try again soon
        raise kopf.TemporaryError(str(exc), delay=RETRY_SECONDS) from exc
