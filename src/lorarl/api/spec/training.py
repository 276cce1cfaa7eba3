"""The training section of the LoRARLJob spec (`spec.training`): the loop's sizes, its outputs
and the evals on data.valFiles."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from lorarl.api.base import ApiModel
from lorarl.api.rules import Rule, enforce, rules_schema_extra
from lorarl.api.spec.k8s import VolumeClaim

DEFAULT_TOTAL_STEPS = 100
Export = Literal["adapter", "merged"]


def _adapter_only() -> list[Export]:
    return ["adapter"]


_GREEDY_ONE_SAMPLE = Rule(
    cel="self.n == 1 || self.temperature > 0",
    message="greedy decoding (temperature 0) gives n identical samples: set n to 1 or "
    "temperature above 0",
    check=lambda m: m.n == 1 or m.temperature > 0,
    field="n",
)


class EvalSpec(ApiModel):
    """How the validation prompts (data.valFiles) are sampled and judged at an eval."""

    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_GREEDY_ONE_SAMPLE))

    n: int = Field(
        default=1, ge=1, le=1024, description="Samples per prompt; pass@k for k = 1, 2, 4, .. <= n."
    )
    temperature: float = Field(
        default=0.0, ge=0, le=10, description="Sampling temperature (0: greedy, the default)."
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass at eval.")
    min_p: float = Field(default=0.0, ge=0, le=1, description="Min-p at eval (0: off).")
    repetition_penalty: float = Field(
        default=1.0, gt=0, le=2, description="Repetition penalty at eval (1: off)."
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        le=131072,
        description="Completion length limit at eval (data.maxResponseTokens if unset).",
    )
    max_prompts: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Evaluate the first N validation prompts only (all if unset).",
    )
    correct_threshold: float = Field(
        default=1.0,
        ge=-1e6,
        le=1e6,
        description="A sample counts as correct (accuracy, pass@k) when its reward is at least "
        "this (1.0: a right answer in every built-in verifiable reward).",
    )

    _rules = enforce(_GREEDY_ONE_SAMPLE)


_EXPORT_RULE = Rule(
    cel="'adapter' in self.export",
    message="must list adapter (always written: the job's status points at it); add merged for "
    "a merged model too",
    check=lambda m: "adapter" in m.export,
    field="export",
)


def _eval_defaults_cel() -> str:
    """CEL: training.eval is all defaults (absent fields count as defaults)."""
    parts = []
    for alias, info in ((f.alias, f) for f in EvalSpec.model_fields.values()):
        if info.default is None:
            parts.append(f"!has(self.eval.{alias})")
        else:
            parts.append(f"(!has(self.eval.{alias}) || self.eval.{alias} == {info.default!r})")
    return "!has(self.eval) || (" + " && ".join(parts) + ")"


_EVALS_ON_CEL = (
    "(has(self.evalInterval) && self.evalInterval > 0) || "
    "(has(self.evalBeforeTrain) && self.evalBeforeTrain)"
)
# Settings of a feature that is off are ignored: refused, like logging settings without their
# backend.
_EVAL_SETTINGS_UNUSED_RULE = Rule(
    cel=f"{_EVALS_ON_CEL} || {_eval_defaults_cel()}",
    message="eval settings are given but evals are off: set evalInterval or evalBeforeTrain",
    check=lambda m: m.eval_interval > 0 or m.eval_before_train or m.eval == EvalSpec(),
    field="eval",
)
_SAMPLES_PER_STEP_RULE = Rule(
    cel="!has(self.samplesPerStep) || self.samplesPerStep == 4 || "
    "(has(self.samplesInterval) && self.samplesInterval > 0)",
    message="applies when samples are stored: set samplesInterval above 0",
    check=lambda m: m.samples_per_step == 4 or m.samples_interval > 0,
    field="samplesPerStep",
)
# The trainer writes checkpoints and the adapter there; a read-only claim fails the first save.
_OUTPUT_WRITABLE_RULE = Rule(
    cel="!has(self.volume) || !has(self.volume.readOnly) || !self.volume.readOnly",
    message="must be false: the trainer writes checkpoints and the adapter to this claim",
    check=lambda m: m.volume is None or not m.volume.read_only,
    field="volume.readOnly",
)


_STEPS_OR_EPOCHS_RULE = Rule(
    cel="!has(self.totalSteps) || !has(self.epochs)",
    message="set totalSteps or epochs, not both (epochs: the trainer counts the steps from the "
    "training data's size)",
    check=lambda m: m.total_steps is None or m.epochs is None,
    field="epochs",
)


_TRAINING_RULES = (
    _STEPS_OR_EPOCHS_RULE,
    _EXPORT_RULE,
    _OUTPUT_WRITABLE_RULE,
    _EVAL_SETTINGS_UNUSED_RULE,
    _SAMPLES_PER_STEP_RULE,
)


class TrainingSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(*_TRAINING_RULES))

    total_steps: int | None = Field(
        default=None,
        gt=0,
        le=10_000_000,
        description="RL steps to run (100 when neither totalSteps nor epochs is set). One of "
        "totalSteps and epochs.",
    )
    epochs: float | None = Field(
        default=None,
        gt=0,
        le=100_000,
        description="Passes over the training data instead of totalSteps: the trainer runs "
        "ceil(epochs x rows / promptsPerStep) steps, rows counted after prompts over "
        "data.maxPromptTokens are dropped, and reports that total in the job's status.",
    )
    prompts_per_step: int = Field(
        default=16, gt=0, le=65536, description="Prompts per step (each gets groupSize samples)."
    )
    mini_batch_size: int | None = Field(
        default=None,
        gt=0,
        le=65536 * 1024,
        description="Samples per optimizer update within a step (one update per step if unset).",
    )
    micro_batch_size: int = Field(
        default=4, gt=0, le=4096, description="Sequences per forward/backward on each rank."
    )
    max_tokens_per_micro_batch: int | None = Field(
        default=None,
        gt=0,
        le=16_777_216,
        description="Token budget of one forward/backward on each rank (verl's "
        "ppo_max_token_len_per_gpu with use_dynamic_bsz): samples are packed shortest first "
        "into micro-batches of at most this many tokens, counted as rows x longest sample, "
        "and at most microBatchSize rows (raise it to let short samples pack); a longer sample "
        "runs alone. Applies to the update and the logprob (and ppo's value) passes; unset: "
        "microBatchSize alone.",
    )
    checkpoint_interval: int = Field(
        default=50, gt=0, le=10_000_000, description="Save a checkpoint every N steps."
    )
    keep_checkpoints: int = Field(default=3, ge=1, le=1000, description="Checkpoints to keep.")
    resume: Literal["auto", "never", "required"] = Field(
        default="auto",
        description="Checkpoints in outputDir at start: auto continues from the newest (none: "
        "step 0); never refuses to start when outputDir holds another run's checkpoints (this "
        "job's own, after its pods restart, are continued); required refuses to start when "
        "there is none to continue from.",
    )
    output_dir: str = Field(
        default="/workspace/output",
        min_length=1,
        description="Where checkpoints and the final adapter are written: in a cluster, "
        "training.volume's mountPath or a folder under it (a local run uses its run directory).",
    )
    volume: VolumeClaim | None = Field(
        default=None,
        description="PersistentVolumeClaim holding outputDir, mounted read-write on the trainer "
        "pods (required in a cluster: outputs must survive the pods).",
    )
    seed: int = Field(
        default=42,
        ge=0,
        le=2**32 - 1,
        description="Seed for sampling and initialization (the engines seed numpy with it, which "
        "takes 32 bits).",
    )
    export: list[Export] = Field(
        default_factory=_adapter_only,
        min_length=1,
        max_length=2,
        description="What the run leaves in outputDir at the end: adapter (the PEFT adapter, "
        "in adapter/) and, with merged, the base model with the adapter merged in "
        "(merged/: safetensors, config and tokenizer, loadable by transformers and vLLM).",
    )
    off_policy_steps: int = Field(
        default=0,
        ge=0,
        le=1,
        description="1: the engines generate the next step's batch while this step trains, "
        "with weights one step old (generation no longer waits for training; the loss uses "
        "the engines' logprobs as the behavior policy). 0: every batch comes from the newest "
        "weights.",
    )
    samples_interval: int = Field(
        default=0,
        ge=0,
        le=10_000_000,
        description="Every N steps, store a few prompts with their completions, rewards and "
        "advantages (outputDir/samples.jsonl and the logging backends' tables). 0: off.",
    )
    samples_per_step: int = Field(
        default=4, ge=1, le=64, description="Samples stored each samplesInterval steps."
    )
    eval_interval: int = Field(
        default=0,
        ge=0,
        le=10_000_000,
        description="Evaluate on data.valFiles every N steps and after the last step (0: never "
        "during training). Evals run on the rollout engines with the step's weights; their "
        "samples are never trained on.",
    )
    eval_before_train: bool = Field(
        default=False, description="Evaluate on data.valFiles once before the first step."
    )
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Eval sampling settings.")

    _rules = enforce(*_TRAINING_RULES)

    @property
    def steps(self) -> int | None:
        """The steps the job runs as far as the manifest says: totalSteps, 100 when neither it nor
        epochs is given, None with epochs (the trainer counts them: trainer/data/epochs.py). Not a
        stored default: the API server would store it beside epochs."""
        if self.total_steps is not None:
            return self.total_steps
        return None if self.epochs is not None else DEFAULT_TOTAL_STEPS
