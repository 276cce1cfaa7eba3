"""The periodic pass: trainer progress into status, activeDeadlineSeconds, TTL after finish,
and a level-triggered safety net for anything an event did not cover."""

from __future__ import annotations

from typing import Any

import kopf

from lorarl.operator.handlers.common import CONFIG, JOBS, JobPods, run


@kopf.timer(*JOBS, id="tick", interval=CONFIG.timer_seconds, initial_delay=CONFIG.timer_seconds)
async def tick(body: kopf.Body, memo: kopf.Memo, job_pods: JobPods | None = None, **_: Any) -> None:
    await run(memo, body, job_pods, "timer", poll=True)
