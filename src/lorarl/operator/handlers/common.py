"""What every handler shares: the watched resource, the settings, and one way to run a pass."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import kopf

from lorarl.api.resource import GROUP, PLURAL, VERSION
from lorarl.operator.builders import JOB_LABEL, MANAGED_BY
from lorarl.operator.config import OperatorConfig
from lorarl.operator.kube import KubeError
from lorarl.operator.reconciler import Reconciler
from lorarl.operator.status import PodView

if TYPE_CHECKING:  # kopf's type of a label filter; kopf does not export it
    from kopf._core.intents.filters import MetaFilter

JOBS = (GROUP, VERSION, PLURAL)
POD_LABELS: MetaFilter = {JOB_LABEL: kopf.PRESENT, MANAGED_BY[0]: MANAGED_BY[1]}
# The pod index (`pods.job_pods`): (namespace, job) -> the job's pods. kopf passes every index
# to every handler as a keyword its callback protocols do not list, so a handler that reads it
# declares it with a default (the protocols take extra keywords only as optional ones).
JobPods = kopf.Index[tuple[str, str], PodView]
CONFIG = OperatorConfig.from_env()
RETRY_SECONDS = 2.0


def reconciler(memo: Any) -> Reconciler:
    return memo["reconciler"]


def pods_of(index: JobPods | None, namespace: str, name: str) -> list[PodView]:
    """The job's pods from the pod index (kopf keeps it current from the pod watch)."""
    store = index.get((namespace, name)) if index is not None else None
    return list(store) if store is not None else []


async def run(
    memo: Any, body: Mapping[str, Any], index: JobPods | None, trigger: str, poll: bool = False
) -> None:
    meta = body["metadata"]
    pods = pods_of(index, meta.get("namespace") or "default", meta["name"])
    try:
        await reconciler(memo).reconcile(body, pods, trigger=trigger, poll=poll)
    except KubeError as exc:  # the API server said no or did not answer: try again soon
        raise kopf.TemporaryError(str(exc), delay=RETRY_SECONDS) from exc
