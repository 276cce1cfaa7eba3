"""Pure conversions from what the stores read (jobs, trainer progress) to response models."""

from __future__ import annotations

from datetime import datetime, timezone

from lorarl.api.reports.progress import Progress, StepRecord
from lorarl.api.reports.status import Condition, LoRARLJobStatus, StepMetrics
from lorarl.api.resource import LoRARLJob
from lorarl.api.spec.lora import values_here
from lorarl.server.models import JobSummary, SpecSummary

_METRIC_FIELDS = tuple(StepMetrics.model_fields)


def rfc3339(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str | None) -> float | None:
    """Unix time of a Kubernetes timestamp; None when absent or unreadable (age is cosmetic)."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def spec_summary(job: LoRARLJob) -> SpecSummary:
    spec = job.spec
    lora = values_here(spec.lora)  # an adapter's own rank where its folder is here
    return SpecSummary(
        model=spec.model.path,
        algorithm=spec.algorithm.name,
        group_size=spec.algorithm.group_size,
        lora_rank=lora.rank,
        lora_alpha=lora.alpha,
        trainer_replicas=spec.trainer.replicas,
        rollout_replicas=spec.rollout.replicas,
        engine=spec.rollout.engine,
        sync_mode=spec.rollout.sync_mode,
        total_steps=spec.training.steps,
    )


def _condition(progress: Progress) -> Condition:
    # A local run has no operator writing conditions; one condition mirroring the phase keeps the
    # response shape identical to the cluster's.
    when = rfc3339(progress.updated_at)
    if progress.phase == "Starting":
        return Condition(
            type="Running",
            status="False",
            reason="Starting",
            message=progress.message,
            last_transition_time=when,
        )
    return Condition(
        type=progress.phase,
        status="True",
        reason=progress.phase,
        message=progress.message,
        last_transition_time=when,
    )


def status_from_progress(progress: Progress) -> LoRARLJobStatus:
    latest = progress.latest
    metrics = None
    if latest is not None:
        metrics = StepMetrics(**{f: getattr(latest, f) for f in _METRIC_FIELDS})
    finished = progress.phase in ("Succeeded", "Failed")
    return LoRARLJobStatus(
        phase=progress.phase,
        conditions=[_condition(progress)],
        step=progress.step,
        total_steps=progress.total_steps,
        metrics=metrics,
        last_sync=progress.last_sync,
        checkpoint=progress.checkpoint,
        eval=progress.eval,
        baseline_eval=progress.baseline_eval,
        start_time=rfc3339(progress.started_at),
        completion_time=rfc3339(progress.updated_at) if finished else None,
        adapter_path=progress.adapter_path,
    )


def job_summary(
    namespace: str, name: str, status: LoRARLJobStatus | None, created: float | None, now: float
) -> JobSummary:
    status = status or LoRARLJobStatus()
    return JobSummary(
        namespace=namespace,
        name=name,
        phase=status.phase,
        step=status.step,
        total_steps=status.total_steps,
        reward_mean=status.metrics.reward_mean if status.metrics else None,
        last_sync_seconds=status.last_sync.seconds if status.last_sync else None,
        age_seconds=max(0.0, now - created) if created is not None else None,
    )


def dedupe_steps(records: list[StepRecord]) -> list[StepRecord]:
    """Oldest first, one record per step, the newest winning.

    A trainer restarted from a checkpoint re-runs (and re-logs) the steps after it; the history
    shows what the surviving run did.
    """
    by_step = {r.step: r for r in records}
    return [by_step[s] for s in sorted(by_step)]
