"""Response models of the status API (camelCase on the wire, like the CRD it mirrors)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lorarl.api.base import ApiModel, ReportModel
from lorarl.api.reports.progress import StepRecord
from lorarl.api.reports.samples import SampleRecord
from lorarl.api.reports.status import Condition, LoRARLJobStatus

Source = Literal["kubernetes", "local"]


class JobSummary(ReportModel):
    """One row of the job list: what `kubectl get lrj` prints, plus the latest reward."""

    namespace: str = Field(description="Namespace (`local` for `lorarl run --local` jobs).")
    name: str = Field(description="Job name.")
    phase: str | None = Field(default=None, description="Coarse state (Running, Succeeded, ...).")
    step: int | None = Field(default=None, description="Completed RL steps.")
    total_steps: int | None = Field(default=None, description="Steps the job will run.")
    reward_mean: float | None = Field(default=None, description="Mean reward of the last step.")
    last_sync_seconds: float | None = Field(
        default=None, description="Duration of the last weight sync."
    )
    age_seconds: float | None = Field(
        default=None, description="Seconds since the job was created (or started, locally)."
    )


class JobList(ApiModel):
    items: list[JobSummary] = Field(description="Jobs the caller may list, by namespace and name.")


class SpecSummary(ApiModel):
    """The spec fields people ask about first; the full spec stays with kubectl."""

    model: str = Field(description="Base model path or hub id.")
    algorithm: str = Field(description="RL algorithm.")
    group_size: int = Field(description="Samples per prompt.")
    lora_rank: int = Field(description="LoRA rank r.")
    lora_alpha: float = Field(description="LoRA alpha.")
    trainer_replicas: int = Field(description="Trainer pods.")
    rollout_replicas: int = Field(description="Rollout engine pods.")
    engine: str = Field(description="Rollout engine (sglang or vllm).")
    sync_mode: str = Field(description="Weight sync mode (merged or adapter).")
    total_steps: int | None = Field(
        description="Steps requested in the spec (none with training.epochs: the trainer counts "
        "them from the data and reports them in the status)."
    )


class JobDetail(ApiModel):
    namespace: str = Field(description="Namespace.")
    name: str = Field(description="Job name.")
    source: Source = Field(description="Where the job runs: kubernetes or local.")
    spec: SpecSummary | None = Field(
        default=None, description="Spec summary (absent when the stored spec does not parse)."
    )
    status: LoRARLJobStatus = Field(description="Observed state.")
    conditions: list[Condition] = Field(
        default_factory=list, description="status.conditions, repeated for convenience."
    )
    live: bool = Field(description="Whether the status was read from a running trainer just now.")
    detail: str | None = Field(
        default=None, description="Why the data is stale or partial, when it is."
    )


class JobMetrics(ApiModel):
    namespace: str = Field(description="Namespace.")
    name: str = Field(description="Job name.")
    steps: list[StepRecord] = Field(description="The step history, oldest first.")
    live: bool = Field(description="Whether the history came from a running trainer just now.")
    detail: str | None = Field(
        default=None, description="Why the history is stale or empty, when it is."
    )


class JobSamples(ApiModel):
    namespace: str = Field(description="Namespace.")
    name: str = Field(description="Job name.")
    samples: list[SampleRecord] = Field(
        description="The newest sample completions (training.samplesInterval), oldest first."
    )
    live: bool = Field(description="Whether they came from a running trainer just now.")
    detail: str | None = Field(
        default=None, description="Why the list is stale or empty, when it is."
    )


class ErrorDetail(ApiModel):
    detail: str = Field(description="What went wrong, naming the job or the missing right.")


class Health(ApiModel):
    status: Literal["ok"] = "ok"
