"""`spec.runPolicy.suspend` (set by people or by Kueue): delete the pods and keep the
checkpoints; on resume recreate them and the trainer resumes from its newest checkpoint."""

from __future__ import annotations

from typing import Any

import kopf

from lorarl.operator.handlers.common import JOBS, run


@kopf.on.field(*JOBS, id="suspend", field="spec.runPolicy.suspend")
async def suspend_changed(
    old: Any, new: Any, body: kopf.Body, memo: kopf.Memo, job_pods: Any, **_: Any
) -> None:
    if bool(old) == bool(new):
        return
    await run(memo, body, job_pods, "suspend")
