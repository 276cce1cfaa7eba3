"""`spec.rollout.replicas` (also `kubectl scale lrj/x --replicas=N`): add or remove rollout pods
live and re-render the job's config.

Nothing running is touched: a rollout pod's env does not depend on the replica count. A new
pod's sidecar registers in the trainer's sync store, and the trainer adds it to the sync group
at its next step boundary, sending it the current adapter before any generation request; a
removed pod deregisters on SIGTERM and leaves the group the same way
(docs/architecture.md#live-membership).
"""

from __future__ import annotations

from typing import Any

import kopf

from lorarl.operator.handlers.common import JOBS, JobPods, run


# On updates only: at creation the create handler materializes the job, and a field handler
# there would cost kopf one more handling cycle (a progress patch and its watch event) per job.
@kopf.on.update(*JOBS, id="scale", field="spec.rollout.replicas")
async def scaled(
    old: Any,
    new: Any,
    body: kopf.Body,
    memo: kopf.Memo,
    job_pods: JobPods | None = None,
    **_: Any,
) -> None:
    if old is None or old == new:
        return  # the field was added: nothing was running at another size
    kopf.event(
        body,
        type="Normal",
        reason="Scaled",
        message=f"rollout replicas {old} -> {new}; the trainer picks up the change at its "
        "next step",
    )
    await run(memo, body, job_pods, "scale")
