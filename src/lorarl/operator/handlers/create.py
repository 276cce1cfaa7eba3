"""Create and resume: materialize the job plan (children, then pods), idempotently."""

from __future__ import annotations

from typing import Any

import kopf

from lorarl.operator.handlers.common import JOBS, JobPods, reconciler, run


@kopf.on.resume(*JOBS, id="materialize-on-resume")
@kopf.on.create(*JOBS, id="materialize")
async def materialize(
    body: kopf.Body, memo: kopf.Memo, job_pods: JobPods | None = None, **_: Any
) -> None:
    await run(memo, body, job_pods, "create")


@kopf.on.delete(*JOBS, id="forget", optional=True)
async def forget(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Children go with the job through their owner references (the garbage collector)."""
    reconciler(memo).forget(namespace or "default", name)  # the key `common.run` passes on
