"""What trainer rank 0 reports on `GET /progress` and `GET /progress/history`.

One model shared by the trainer (writer), the status API and the operator (readers), so a field
renamed on one side breaks a test instead of a dashboard.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from lorarl.api.base import ReportModel
from lorarl.api.reports.status import CheckpointStatus, EvalRecord, SyncStatus


class StepRecord(ReportModel):
    model_config = ConfigDict(extra="ignore")  # readers tolerate newer trainers

    step: int = Field(ge=1, description="1-based step number.")
    time: float = Field(description="Unix time the step finished.")
    reward_mean: float
    reward_std: float = 0.0
    kl: float | None = None
    entropy: float | None = None
    loss: float | None = None
    clip_fraction: float | None = None
    clip_fraction_first_update: float | None = Field(
        default=None,
        description="Clip fraction of the step's first optimizer update, before the policy moved: "
        "0 unless the trainer scores a different distribution than its old-logprob pass.",
    )
    grad_norm: float | None = None
    lr: float | None = None
    tokens_per_second: float | None = None
    response_length_mean: float | None = None
    logprob_mismatch: float | None = Field(
        default=None, description="Mean |rollout logprob - trainer logprob| per token."
    )
    logprob_mismatch_p50: float | None = Field(
        default=None, description="Median |rollout - trainer| logprob per token (bin upper edge)."
    )
    logprob_mismatch_p90: float | None = None
    logprob_mismatch_p99: float | None = None
    tis_clip_frac: float | None = Field(
        default=None,
        description="Fraction of tokens whose rollout-correction weight was truncated or masked.",
    )
    truncated_fraction: float | None = Field(
        default=None,
        description="Fraction of completions cut at maxResponseTokens (episodes: ended by a "
        "limit, not by the environment).",
    )
    weight_version: int | None = Field(default=None, description="Version the samples came from.")
    # ppo only (the critic and the KL penalty in the rewards); unset for the other algorithms
    value_loss: float | None = Field(
        default=None, description="ppo: the critic's clipped value loss (before vfCoef)."
    )
    value_clip_fraction: float | None = Field(
        default=None,
        description="ppo: fraction of response tokens where the clipped value loss was the "
        "larger (the value moved more than valueClip).",
    )
    explained_variance: float | None = Field(
        default=None,
        description="ppo: 1 - Var(returns - values) / Var(returns) over the response tokens: 1 "
        "a perfect critic, 0 no better than a constant, below 0 worse.",
    )
    value_mean: float | None = Field(
        default=None, description="ppo: mean critic value over the response tokens."
    )
    critic_grad_norm: float | None = Field(
        default=None, description="ppo: the critic's gradient norm before its clip."
    )
    kl_coef: float | None = Field(
        default=None,
        description="ppo with kl.inReward: the beta of the KL penalty in the rewards this step "
        "(moves with the adaptive controller).",
    )
    kl_in_reward: float | None = Field(
        default=None,
        description="ppo with kl.inReward: mean per-token KL of the penalty, before beta.",
    )
    # spec.environment only (multi-turn episodes); unset for single-turn jobs
    turns_mean: float | None = Field(
        default=None, description="Mean assistant turns per episode this step."
    )
    tool_calls: float | None = Field(
        default=None, description="Tool calls this step, over every episode (the environment's)."
    )
    tool_errors: float | None = Field(
        default=None,
        description="Tool calls this step that failed (unknown tool, bad arguments, tool error).",
    )
    failed_episodes: int | None = Field(
        default=None,
        description="spec.agent: agent episodes that failed this step (an exception, the "
        "timeout, no model call, a bad return); their groups were not trained.",
    )
    skipped_prompts: int | None = Field(
        default=None,
        description="Prompts skipped this step because the environment's first messages came "
        "out over maxPromptTokens at run time (the load-time filter measures them with seed 0).",
    )
    environment_seconds: float | None = Field(
        default=None,
        description="Wall seconds of generateSeconds during which an environment was running "
        "(concurrent episodes counted once).",
    )
    step_seconds: float | None = None
    cpu_util: float | None = Field(
        default=None,
        description="Busy fraction of the machine's cores over the step (/proc/stat, 0..1): on "
        "a local run, the run's; in a pod, the node's.",
    )
    generate_seconds: float | None = None
    reward_seconds: float | None = None
    train_seconds: float | None = None
    sync_seconds: float | None = None
    sync_bytes: int | None = None
    sync_check_seconds: float | None = Field(
        default=None,
        description="Seconds of the stale-policy guard this step: the trainer's probe forward "
        "after the update, and the probe requests to the engines (rollout.syncCheck).",
    )
    logprob_mismatch_by_replica: dict[str, float] | None = Field(
        default=None,
        description="logprob_mismatch per rollout replica (by name): the mean |engine - "
        "trainer| logprob per token of the samples each generated. One far above the others "
        "serves other weights than it should (the trainer logs a warning).",
    )
    sync_check_gap: float | None = Field(
        default=None,
        description="The largest mean |engine - trainer| probe logprob gap among the replicas "
        "that proved the step's weight version (their margin to rollout.syncCheck.tolerance).",
    )
    sync_members: int | None = Field(
        default=None,
        description="Rollout sidecars in the weight-sync group at this step's publish (live "
        "membership: replicas join and leave between steps).",
    )
    engine_requests: dict[str, int] | None = Field(
        default=None,
        description="Generation requests sent to each rollout replica this step, by replica "
        "name (rollout-<index>); a replica that joined mid-run shows up here.",
    )
    engine_rewards: dict[str, float] | None = Field(
        default=None,
        description="Mean reward of the samples each rollout replica generated this step, by "
        "replica name. Noisy with few prompts per replica; one serving wrong weights falls "
        "apart from the others, and logprob_mismatch rises with it.",
    )
    reward_metrics: dict[str, float] | None = Field(
        default=None,
        description="The reward function's own metrics, each a mean over this step's samples "
        "that reported it (a returned dict's numbers besides score, e.g. verl's acc); "
        "trackers show them as reward_metrics/<name>. Unset when the reward reports none.",
    )
    eval: EvalRecord | None = Field(
        default=None,
        description="Eval on data.valFiles by this step's weights (every training.evalInterval "
        "steps); its time is not in this step's timings.",
    )


class Progress(ReportModel):
    model_config = ConfigDict(extra="ignore")

    job: str
    phase: Literal["Starting", "Running", "Succeeded", "Failed"]
    step: int = Field(default=0, ge=0)
    total_steps: int = Field(ge=0)
    latest: StepRecord | None = None
    last_sync: SyncStatus | None = None
    checkpoint: CheckpointStatus | None = None
    adapter_path: str | None = None
    eval: EvalRecord | None = Field(default=None, description="Latest eval on data.valFiles.")
    baseline_eval: EvalRecord | None = Field(
        default=None, description="The eval before training (training.evalBeforeTrain)."
    )
    dropped_prompts: int = Field(
        default=0, ge=0, description="Training prompts dropped at load: over maxPromptTokens."
    )
    skipped_prompts: int = Field(
        default=0,
        ge=0,
        description="Training prompts skipped at run time, summed over the recorded steps: the "
        "environment's first messages came out over maxPromptTokens.",
    )
    message: str = ""
    started_at: float | None = None
    updated_at: float | None = None
