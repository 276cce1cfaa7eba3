"""`spec.runPolicy.suspend` (set by people or by Kueue): delete the pods and keep the
checkpoints; on resume recreate them and the trainer resumes from its newest checkpoint."""

from __future__ import annotations

from typing import Any

import kopf

from lorarl.operator.handlers.common import JOBS, JobPods, run


# On updates only: a job created suspended is held by the create handler's pass (decide reads
# the flag), without a second handling cycle per job.
@kopf.on.update(*JOBS, id="suspend", field="spec.runPolicy.suspend")
async def suspend_changed(
    old: Any,
    new: Any,
    body: kopf.Body,
    memo: kopf.Memo,
    job_pods: JobPods | None = None,
    **_: Any,
) -> None:
    if bool(old) == bool(new):
        return
    await run(memo, body, job_pods, "suspend")
