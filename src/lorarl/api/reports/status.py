"""LoRARLJob status: written by the operator (or the local runner), read by kubectl and the API."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lorarl.api.base import ReportModel

Phase = Literal["Pending", "Starting", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
ConditionType = Literal[
    "Created", "RolloutReady", "TrainerReady", "Running", "Succeeded", "Failed", "Suspended"
]


class Condition(ReportModel):
    """metav1.Condition."""

    type: str = Field(description="Condition type, e.g. Running.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason for the last transition.")
    message: str = Field(default="", description="Human-readable details.")
    last_transition_time: str | None = Field(
        default=None, description="When the status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, description="The spec generation the condition was computed from."
    )


class StepMetrics(ReportModel):
    reward_mean: float | None = Field(default=None, description="Mean reward of the last step.")
    reward_std: float | None = Field(default=None, description="Reward standard deviation.")
    kl: float | None = Field(default=None, description="KL to the base model.")
    entropy: float | None = Field(default=None, description="Mean token entropy.")
    clip_fraction: float | None = Field(default=None, description="Fraction of clipped tokens.")
    grad_norm: float | None = Field(default=None, description="Gradient norm before clipping.")
    tokens_per_second: float | None = Field(
        default=None, description="Generated + trained tokens per second over the step."
    )
    logprob_mismatch: float | None = Field(
        default=None, description="Mean |rollout logprob - trainer logprob| per token."
    )
    logprob_mismatch_p50: float | None = Field(
        default=None, description="Median |rollout - trainer| logprob per token."
    )
    logprob_mismatch_p90: float | None = Field(
        default=None, description="90th percentile |rollout - trainer| logprob per token."
    )
    logprob_mismatch_p99: float | None = Field(
        default=None, description="99th percentile |rollout - trainer| logprob per token."
    )
    tis_clip_frac: float | None = Field(
        default=None,
        description="Fraction of tokens whose rollout-correction weight was truncated or masked.",
    )
    clip_fraction_first_update: float | None = Field(
        default=None,
        description="Clip fraction of the step's first optimizer update (0 unless the trainer "
        "scores a different distribution than its old-logprob pass).",
    )
    truncated_fraction: float | None = Field(
        default=None, description="Fraction of completions cut at maxResponseTokens."
    )
    response_length_mean: float | None = Field(
        default=None, description="Mean completion length in tokens."
    )
    weight_version: int | None = Field(
        default=None, description="Adapter version the step's samples came from."
    )
    value_loss: float | None = Field(
        default=None, description="ppo: the critic's clipped value loss (before vfCoef)."
    )
    value_clip_fraction: float | None = Field(
        default=None,
        description="ppo: fraction of response tokens whose value loss was clipped (valueClip).",
    )
    explained_variance: float | None = Field(
        default=None,
        description="ppo: 1 - Var(returns - values) / Var(returns): 1 a perfect critic, 0 no "
        "better than a constant.",
    )
    value_mean: float | None = Field(
        default=None, description="ppo: mean critic value over the response tokens."
    )
    critic_grad_norm: float | None = Field(
        default=None, description="ppo: the critic's gradient norm before its clip."
    )
    kl_coef: float | None = Field(
        default=None, description="ppo with kl.inReward: the beta of the KL penalty in use."
    )
    kl_in_reward: float | None = Field(
        default=None,
        description="ppo with kl.inReward: mean per-token KL of the penalty, before beta.",
    )


class SyncStatus(ReportModel):
    version: int = Field(default=0, ge=0, description="Adapter version the engines serve.")
    seconds: float | None = Field(default=None, description="Duration of the last sync.")
    bytes: int | None = Field(default=None, description="Bytes sent in the last sync.")
    mode: Literal["merged", "adapter"] | None = Field(default=None, description="Sync mode.")
    time: str | None = Field(default=None, description="When the last sync finished.")
    members: int | None = Field(
        default=None, ge=0, description="Rollout sidecars that received the last sync."
    )


class SourceEval(ReportModel):
    """An eval's numbers over the prompts of one data source (the rows' `data_source`)."""

    reward_mean: float = Field(description="Mean reward over the source's eval samples.")
    accuracy: float = Field(ge=0, le=1, description="Fraction of its samples that are correct.")
    prompts: int = Field(ge=1, description="Validation prompts of this source.")


class EvalRecord(ReportModel):
    """One evaluation on data.valFiles: the engines at the weights after `step` steps sample
    `samplesPerPrompt` completions per validation prompt, scored with the job's reward.

    A sample is *correct* when its reward is >= training.eval.correctThreshold (1.0 by default:
    the score of a right answer in every built-in verifiable reward)."""

    step: int = Field(ge=0, description="Steps trained before this eval (0: before training).")
    reward_mean: float = Field(description="Mean reward over every eval sample.")
    accuracy: float = Field(ge=0, le=1, description="Fraction of eval samples that are correct.")
    pass_at_k: dict[str, float] = Field(
        default_factory=dict,
        description="pass@k by k (powers of 2 up to samplesPerPrompt): the chance that at least "
        "one of k samples of a prompt is correct (unbiased estimator), averaged over prompts.",
    )
    prompts: int = Field(ge=0, description="Validation prompts evaluated.")
    samples_per_prompt: int = Field(ge=1, description="Samples per prompt (training.eval.n).")
    seconds: float = Field(ge=0, description="Wall time of the eval (generation and scoring).")
    by_source: dict[str, SourceEval] = Field(
        default_factory=dict,
        description="The same numbers per data source, when the validation rows have a "
        "`data_source` column (rows without one count as `unknown`); empty otherwise.",
    )

    def line(self) -> str:
        """One human line, for the trainer's log and the local console."""
        when = "before training" if self.step == 0 else f"step {self.step}"
        passes = " ".join(f"pass@{k} {v:.3f}" for k, v in self.pass_at_k.items())
        sources = ""
        if len(self.by_source) > 1:
            shown = [f"{name} {s.accuracy:.3f}" for name, s in list(self.by_source.items())[:8]]
            more = len(self.by_source) - len(shown)
            sources = "; by source: " + ", ".join(shown) + (f", +{more} more" if more else "")
        return (
            f"eval {when}: accuracy {self.accuracy:.3f}, reward {self.reward_mean:.3f}, "
            f"{passes} ({self.prompts} prompts x {self.samples_per_prompt}, {self.seconds:.1f} s)"
            f"{sources}"
        )


class CheckpointStatus(ReportModel):
    step: int = Field(ge=0, description="Step of the newest complete checkpoint.")
    path: str = Field(description="Where it is.")
    time: str | None = Field(default=None, description="When it was written.")


class ModelStatus(ReportModel):
    """A hub id's download: what every pod of the job loads."""

    source: str = Field(description="The hub id (spec.model.path).")
    revision: str = Field(description="The commit the job's pods load (pinned at first fetch).")


class PrinterColumns(ReportModel):
    """The status as `kubectl get lrj` prints it (a printer column cannot format a number)."""

    steps: str | None = Field(default=None, description="Completed of total steps, e.g. 12/40.")
    reward: str | None = Field(
        default=None, description="Mean reward of the last step, 3 decimals."
    )
    eval: str | None = Field(default=None, description="Latest eval accuracy, 3 decimals.")


class LoRARLJobStatus(ReportModel):
    phase: Phase | None = Field(default=None, description="Coarse state of the job.")
    conditions: list[Condition] = Field(default_factory=list, description="Detailed state.")
    observed_generation: int | None = Field(
        default=None, description="The spec generation the status reflects."
    )
    step: int | None = Field(default=None, ge=0, description="Completed RL steps.")
    total_steps: int | None = Field(default=None, ge=0, description="Steps the job will run.")
    metrics: StepMetrics | None = Field(default=None, description="Latest step metrics.")
    last_sync: SyncStatus | None = Field(default=None, description="Latest weight sync.")
    checkpoint: CheckpointStatus | None = Field(default=None, description="Newest checkpoint.")
    model: ModelStatus | None = Field(
        default=None, description="The commit of a hub id model that every pod loads."
    )
    eval: EvalRecord | None = Field(default=None, description="Latest eval on data.valFiles.")
    baseline_eval: EvalRecord | None = Field(
        default=None, description="The eval before training (training.evalBeforeTrain)."
    )
    restarts: int = Field(default=0, ge=0, description="Trainer group restarts so far.")
    rollout_restarts: int = Field(
        default=0,
        ge=0,
        description="Rollout pods recreated after they failed or ended (not preempted); never "
        "counted against runPolicy.backoffLimit.",
    )
    rollout_preemptions: int = Field(
        default=0,
        ge=0,
        description="Rollout pods recreated after their node took them away (spot preemption, "
        "node shutdown or loss, eviction, or a deletion the operator did not make); never "
        "counted against runPolicy.backoffLimit.",
    )
    start_time: str | None = Field(
        default=None, description="When the job was first admitted (not suspended or queued)."
    )
    active_seconds: int = Field(
        default=0,
        ge=0,
        description="Seconds the job was admitted and not suspended, up to activeSince: what "
        "runPolicy.activeDeadlineSeconds is measured against (with the current stretch).",
    )
    active_since: str | None = Field(
        default=None,
        description="Start of the current admitted, unsuspended stretch (unset while the job "
        "is suspended, queued or finished).",
    )
    completion_time: str | None = Field(default=None, description="When the job finished.")
    adapter_path: str | None = Field(default=None, description="The trained adapter (output).")
    rollout_replicas: int | None = Field(
        default=None, description="Rollout pods that exist (for the scale subresource)."
    )
    rollout_selector: str | None = Field(
        default=None, description="Label selector of the rollout pods (for autoscalers)."
    )
    columns: PrinterColumns | None = Field(
        default=None, description="What `kubectl get lrj` prints (formatted by the operator)."
    )

    def with_columns(self) -> LoRARLJobStatus:
        """This status with `columns` computed from its step, total, reward and eval."""
        reward = self.metrics.reward_mean if self.metrics else None
        columns = PrinterColumns(
            steps=f"{self.step or 0}/{self.total_steps}" if self.total_steps is not None else None,
            reward=None if reward is None else f"{reward:.3f}",
            eval=None if self.eval is None else f"{self.eval.accuracy:.3f}",
        )
        return self.model_copy(update={"columns": columns})
