"""`spec.rollout.replicas` (also `kubectl scale lrj/x --replicas=N`): add or remove rollout pods
live and re-render the job's config.

The weight-sync group is formed once, at trainer start, with LORARL_SYNC_WORLD_SIZE = 1 + the
rollout replicas. New rollout pods are rendered with the new world size and rank; existing pods
and the trainer keep their env (pods are immutable). Live scaling therefore needs the trainer to
re-form its sync group when the membership in its config file (`spec.rollout.replicas` in the
mounted job.yaml) changes; until it does, new engines serve generation but receive no updates.
"""

from __future__ import annotations

from typing import Any

import kopf

from lorarl.operator.handlers.common import JOBS, run


# On updates only: at creation the create handler materializes the job, and a field handler
# there would cost kopf one more handling cycle (a progress patch and its watch event) per job.
@kopf.on.update(*JOBS, id="scale", field="spec.rollout.replicas")
async def scaled(
    old: Any, new: Any, body: kopf.Body, memo: kopf.Memo, job_pods: Any, **_: Any
) -> None:
    if old is None or old == new:
        return  # the field was added: nothing was running at another size
    kopf.event(
        body,
        type="Normal",
        reason="Scaled",
        message=f"rollout replicas {old} -> {new}; "
        f"the sync group world size becomes {1 + int(new)}",
    )
    await run(memo, body, job_pods, "scale")
