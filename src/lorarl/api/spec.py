"""The LoRARLJob spec. Every field is documented: the CRD (and `kubectl explain`) is generated
from these models. The algorithm and the pod sections live in `algorithm` and `workloads`; the
names other modules import from here are re-exported (`__all__`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from lorarl.api.algorithm import GROUP_ALGORITHMS, Algorithm, AlgorithmSpec, OptimSpec
from lorarl.api.base import INT64_MAX, MAX_SECONDS, ApiModel
from lorarl.api.k8s import (
    ResourceRequirements,
    VolumeClaim,
)
from lorarl.api.rules import Rule, crd_only, enforce, rules_schema_extra
from lorarl.api.safe_yaml import EXCERPT_CHARS
from lorarl.api.tracking import TRACKING_SPEC_RULES, LoggingSpec
from lorarl.api.workloads import (
    RESERVED_ENV,
    RolloutSpec,
    RunPolicy,
    SchedulingSpec,
    TrainerSpec,
)

Dtype = Literal["float32", "bfloat16", "float16"]


# A hub id ("gpt2", "org/name") is at most two plain parts; a folder is absolute, starts with
# "." or "~", or has more parts. Nothing is downloaded at run time, so a hub id is refused.
_HUB_ID_RE = r"^[^./~][^/]*(/[^/]*)?$"
_MODEL_PATH_RULE = Rule(
    cel=f"!self.path.matches('{_HUB_ID_RE}')",
    message="must be a folder path (absolute, or relative starting with ./), not a Hugging Face "
    "hub id: nothing is downloaded at run time",
    check=lambda m: re.match(_HUB_ID_RE, m.path) is None,
    field="path",
)


class ModelSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_MODEL_PATH_RULE))

    path: str = Field(
        min_length=1,
        description="Base model: a local folder (on `volume` in a cluster) holding a Hugging Face "
        "model in safetensors. Hub ids are refused: nothing is downloaded at run time.",
    )
    volume: VolumeClaim | None = Field(
        default=None, description="PersistentVolumeClaim the model lives on, mounted read-only."
    )
    dtype: Dtype = Field(
        default="bfloat16", description="Weights dtype for training and rollout (float32 on CPU)."
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Allow model code from the model folder, in the trainer and the engines "
        "(off: safer).",
    )

    _rules = enforce(_MODEL_PATH_RULE)


_ALL_LINEAR_ALONE = Rule(
    cel="!('all-linear' in self.targetModules) || size(self.targetModules) == 1",
    message="'all-linear' cannot be combined with other module names",
    check=lambda m: "all-linear" not in m.target_modules or len(m.target_modules) == 1,
    field="targetModules",
)


class LoraSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_ALL_LINEAR_ALONE))

    rank: int = Field(default=32, gt=0, le=1024, description="LoRA rank r.")
    alpha: float = Field(
        default=32.0, gt=0, le=65536, description="LoRA alpha; the update is scaled by alpha/r."
    )
    dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Dropout on the LoRA input, written to the exported adapter's config for a "
        "later supervised fine-tune. Not applied during RL: the engines sample without dropout, "
        "so every trainer pass runs without it (as TRL and verl do).",
    )
    target_modules: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: ["all-linear"],
        min_length=1,
        max_length=64,
        description="Modules to adapt: ['all-linear'] (every linear layer but the output head, "
        "as 'LoRA Without Regret' advises) or a list of module names such as q_proj, v_proj.",
    )
    exclude_modules: list[str] = Field(
        default_factory=list, max_length=64, description="Module names to leave without LoRA."
    )
    use_rslora: bool = Field(
        default=False, description="Rank-stabilized LoRA: scale by alpha/sqrt(r) instead."
    )
    adapter_path: str | None = Field(
        default=None,
        description="Start from this existing PEFT adapter folder (its rank must equal `rank`).",
    )

    _rules = enforce(_ALL_LINEAR_ALONE)


_SEED_WITHOUT_SHUFFLE_RULE = Rule(
    cel="!has(self.seed) || self.seed == 0 || !has(self.shuffle) || self.shuffle",
    message="seeds the shuffle, which is off: leave it unset or set shuffle true",
    check=lambda m: m.shuffle or m.seed == 0,
    field="seed",
)


class DataSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_SEED_WITHOUT_SHUFFLE_RULE))

    train_files: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1,
        description="Prompt sources: .jsonl or .parquet files, folders of such shards, or "
        "folders written by Hugging Face datasets' save_to_disk (verl's preprocessed parquet "
        "reads as is).",
    )
    val_files: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="Validation prompt files (same format as trainFiles), never trained on: "
        "evaluated every training.evalInterval steps.",
    )
    volume: VolumeClaim | None = Field(
        default=None,
        description="PersistentVolumeClaim holding the data files, mounted read-only on the "
        "trainer pods.",
    )
    prompt_key: str = Field(
        default="prompt",
        min_length=1,
        description="Field with the prompt (text or chat list); dots reach into nested fields.",
    )
    answer_key: str = Field(
        default="answer",
        min_length=1,
        description="Field with the ground truth for the reward; dots reach into nested fields "
        "(verl's parquet: reward_model.ground_truth).",
    )
    system_prompt: str | None = Field(
        default=None, description="System message prepended to every prompt."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the model's chat template, passed as written, e.g. "
        "{enable_thinking: false} for Qwen3; used wherever prompts are rendered.",
    )
    max_prompt_tokens: int = Field(
        default=512,
        gt=0,
        le=131072,
        description="Prompts longer than this (rendered with the chat template) are dropped when "
        "the data is loaded; the count is logged and reported in the progress (droppedPrompts).",
    )
    max_response_tokens: int = Field(
        default=256, gt=0, le=131072, description="Completion length limit."
    )
    shuffle: bool = Field(default=True, description="Shuffle prompts every epoch.")
    seed: int = Field(default=0, ge=0, le=INT64_MAX, description="Shuffle seed.")

    _rules = enforce(_SEED_WITHOUT_SHUFFLE_RULE)


_MAX_REPLICAS_RULE = Rule(
    cel="!has(self.maxReplicas) || self.maxReplicas >= self.replicas",
    message="must be at least replicas (the autoscaler's lower bound)",
    check=lambda m: m.max_replicas is None or m.max_replicas >= m.replicas,
    field="maxReplicas",
)


def _resources_set(r: ResourceRequirements) -> bool:
    return bool(r.requests or r.limits)


# replicas, maxReplicas and resources size the service lorarl runs; an external one sizes itself.
_EXTERNAL_SERVICE_RULE = Rule(
    cel="!has(self.url) || ((!has(self.replicas) || self.replicas == 1) && "
    "!has(self.maxReplicas) && (!has(self.resources) || ((!has(self.resources.requests) || "
    "size(self.resources.requests) == 0) && (!has(self.resources.limits) || "
    "size(self.resources.limits) == 0))))",
    message="replicas, maxReplicas and resources size the reward service lorarl runs; with url "
    "(your own service) they would be ignored: leave them unset",
    check=lambda m: (
        m.url is None
        or (m.replicas == 1 and m.max_replicas is None and not _resources_set(m.resources))
    ),
)


class RewardServiceSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra=rules_schema_extra(_MAX_REPLICAS_RULE, _EXTERNAL_SERVICE_RULE)
    )

    url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        description="An existing reward service (e.g. a KubeRay RayService); lorarl runs one "
        "itself when unset.",
    )
    replicas: int = Field(default=1, ge=1, le=64, description="Serve replicas per deployment.")
    max_replicas: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Autoscaling upper bound (autoscaling off if unset).",
    )
    timeout_seconds: float = Field(
        default=60.0, gt=0, le=MAX_SECONDS, description="Timeout per scoring call."
    )
    max_retries: int = Field(default=3, ge=0, le=20, description="Retries before the step fails.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Reward pod resources."
    )

    _rules = enforce(_MAX_REPLICAS_RULE, _EXTERNAL_SERVICE_RULE)


_ONE_REWARD_SOURCE = Rule(
    cel="(has(self.function) ? 1 : 0) + (has(self.entrypoint) ? 1 : 0) == 1",
    message="set exactly one of function or entrypoint",
    check=lambda m: (m.function is not None) + (m.entrypoint is not None) == 1,
)


# The /score protocol carries the reward's name, not its params: an external service scores
# with its own. Python only (params is schemaless in the CRD, out of CEL's reach).
_EXTERNAL_PARAMS_RULE = Rule(
    cel=None,
    message="an external reward service (service.url) scores with its own settings; params "
    "would be ignored: leave them empty",
    check=lambda m: m.service is None or m.service.url is None or not m.params,
    field="params",
)


class RewardSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_ONE_REWARD_SOURCE))

    function: str | None = Field(
        default=None,
        min_length=1,
        description="Built-in reward: exact_match, math_answer, multiple_choice, regex_match, "
        "json_valid, format, ...",
    )
    entrypoint: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="A reward function from your image, as module:function.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the reward function (not with service.url: an "
        "external service scores with its own settings).",
    )
    service: RewardServiceSpec | None = Field(
        default=None,
        description="Score through a Ray Serve reward service instead of inside the trainer; "
        "each request names the reward (function or entrypoint).",
    )

    _rules = enforce(_ONE_REWARD_SOURCE, _EXTERNAL_PARAMS_RULE)

    @model_validator(mode="after")
    def _known_reward(self, info: ValidationInfo) -> RewardSpec:
        """A built-in name and its params are checked where the job is admitted (`lorarl
        validate`, the webhook), not first when the trainer starts; nothing heavy is imported.
        Python only: the CRD cannot know the registry. An external service (service.url)
        defines its own names."""
        external = self.service is not None and self.service.url is not None
        if self.function is None or external or crd_only(info):
            return self
        from lorarl.rewards.registry import UnknownRewardError, check_reward

        try:
            check_reward(self.function, self.params)
        except UnknownRewardError as exc:
            field, value, message = "function", self.function, str(exc)
        except ValueError as exc:
            field, value, message = "params", self.params, str(exc)
        else:
            return self
        if len(message) > 2 * EXCERPT_CHARS:
            message = message[: 2 * EXCERPT_CHARS - 3] + "..."
        raise PydanticCustomError(
            "rule", "{message}", {"message": message, "field": field, "value": value}
        )


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


_TRAINING_RULES = (
    _EXPORT_RULE,
    _OUTPUT_WRITABLE_RULE,
    _EVAL_SETTINGS_UNUSED_RULE,
    _SAMPLES_PER_STEP_RULE,
)


class TrainingSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(*_TRAINING_RULES))

    total_steps: int = Field(default=100, gt=0, le=10_000_000, description="RL steps to run.")
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
    checkpoint_interval: int = Field(
        default=50, gt=0, le=10_000_000, description="Save a checkpoint every N steps."
    )
    keep_checkpoints: int = Field(default=3, ge=1, le=1000, description="Checkpoints to keep.")
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
    export: list[Literal["adapter", "merged"]] = Field(
        default_factory=lambda: ["adapter"],
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


_MINI_BATCH_RULE = Rule(
    cel="!has(self.training.miniBatchSize) || "
    "(self.training.promptsPerStep * self.algorithm.groupSize) % self.training.miniBatchSize == 0",
    message="must divide promptsPerStep * groupSize (the samples of one step)",
    check=lambda m: (
        m.training.mini_batch_size is None
        or (m.training.prompts_per_step * m.algorithm.group_size) % m.training.mini_batch_size == 0
    ),
    field="training.miniBatchSize",
)
_SERVICE_REWARD_RULE = Rule(
    cel="!has(self.reward.service) || !has(self.reward.entrypoint) || has(self.reward.service.url)",
    message="a module:function reward can only be served by your own service (set service.url)",
    check=lambda m: (
        m.reward.service is None or m.reward.entrypoint is None or m.reward.service.url is not None
    ),
    field="reward",
)


def _output_on_volume(t: TrainingSpec) -> bool:
    if t.volume is None:
        return True  # the rule above reports it
    root = t.volume.mount_path.rstrip("/") + "/"
    return t.output_dir == t.volume.mount_path or t.output_dir.startswith(root)


# A pod's root filesystem is read-only and dies with the pod: checkpoints and the adapter need a
# claim that outlives it (a restarted trainer group resumes from it; the adapter is the product).
_OUTPUT_VOLUME_RULE = Rule(
    cel="has(self.training) && has(self.training.volume)",
    message="a cluster run needs a PersistentVolumeClaim for outputDir (checkpoints and the "
    "adapter must outlive the pods); `lorarl run --local` writes under its run directory instead",
    check=lambda m: m.training.volume is not None,
    field="training.volume",
    cluster=True,
)
_OUTPUT_ON_VOLUME_RULE = Rule(
    cel="!has(self.training) || !has(self.training.volume) || "
    "self.training.outputDir == self.training.volume.mountPath || "
    "self.training.outputDir.startsWith(self.training.volume.mountPath.endsWith('/') ? "
    "self.training.volume.mountPath : self.training.volume.mountPath + '/')",
    message="must be training.volume.mountPath or a folder under it (the rest of a pod's "
    "filesystem is read-only)",
    check=lambda m: _output_on_volume(m.training),
    field="training.outputDir",
    cluster=True,
)
# Paths lorarl mounts in every pod (the rendered config, shared memory, the writable /tmp).
RESERVED_MOUNT_PATHS = ("/etc/lorarl", "/dev/shm", "/tmp")
_CLAIMS = (
    ("has(self.model.volume)", "self.model.volume.mountPath"),
    ("has(self.data.volume)", "self.data.volume.mountPath"),
    ("has(self.training) && has(self.training.volume)", "self.training.volume.mountPath"),
)


def _mount_paths_cel() -> str:
    """The claims' mount paths must differ from each other and from lorarl's own."""
    reserved = "[" + ", ".join(f"'{p}'" for p in RESERVED_MOUNT_PATHS) + "]"
    checks = [f"!({h}) || !({p} in {reserved})" for h, p in _CLAIMS]
    for i, (h1, p1) in enumerate(_CLAIMS):
        for h2, p2 in _CLAIMS[i + 1 :]:
            checks.append(f"!({h1}) || !({h2}) || {p1} != {p2}")
    return " && ".join(f"({c})" for c in checks)


def _claim_paths(m: LoRARLJobSpec) -> list[str]:
    claims = (m.model.volume, m.data.volume, m.training.volume)
    return [c.mount_path for c in claims if c is not None]


# The API server refuses a Pod whose container mounts two volumes at one path.
_MOUNT_PATHS_RULE = Rule(
    cel=_mount_paths_cel(),
    message="model.volume, data.volume and training.volume need distinct mountPaths, none of "
    + ", ".join(RESERVED_MOUNT_PATHS)
    + " (lorarl mounts those)",
    check=lambda m: (
        len(set(_claim_paths(m))) == len(_claim_paths(m))
        and not set(_claim_paths(m)) & set(RESERVED_MOUNT_PATHS)
    ),
    cluster=True,
)
_EVAL_NEEDS_VAL_RULE = Rule(
    cel="!has(self.training) || ((!has(self.training.evalInterval) || "
    "self.training.evalInterval == 0) && (!has(self.training.evalBeforeTrain) || "
    "!self.training.evalBeforeTrain)) || (has(self.data.valFiles) && size(self.data.valFiles) > 0)",
    message="evalInterval and evalBeforeTrain need validation prompts in data.valFiles",
    check=lambda m: (
        (m.training.eval_interval == 0 and not m.training.eval_before_train)
        or len(m.data.val_files) > 0
    ),
    field="data.valFiles",
)
_VAL_FILES_UNUSED_RULE = Rule(
    cel="!has(self.data.valFiles) || size(self.data.valFiles) == 0 || (has(self.training) && "
    "((has(self.training.evalInterval) && self.training.evalInterval > 0) || "
    "(has(self.training.evalBeforeTrain) && self.training.evalBeforeTrain)))",
    message="validation prompts are read by evals only: set training.evalInterval or "
    "training.evalBeforeTrain (or leave valFiles out)",
    check=lambda m: (
        not m.data.val_files or m.training.eval_interval > 0 or m.training.eval_before_train
    ),
    field="data.valFiles",
)
_KL_REFERENCE_RULE = Rule(
    cel="self.algorithm.kl.reference != 'initialAdapter' || has(self.lora.adapterPath)",
    message="initialAdapter needs lora.adapterPath (the adapter training starts from)",
    check=lambda m: m.algorithm.kl.reference != "initialAdapter" or bool(m.lora.adapter_path),
    field="algorithm.kl.reference",
)
# vLLM reports the logprobs of the min-p / penalized distribution it sampled from; the trainer
# scores softmax(z / T). Only an importance-sampling correction weighs that gap; without one the
# update would treat penalized samples as the policy's own.
_SHAPED_SAMPLING_RULE = Rule(
    cel="!has(self.rollout) || !has(self.rollout.sampling) || ((!has(self.rollout.sampling.minP) "
    "|| self.rollout.sampling.minP == 0.0) && (!has(self.rollout.sampling.repetitionPenalty) || "
    "self.rollout.sampling.repetitionPenalty == 1.0)) || !has(self.algorithm) || "
    "!has(self.algorithm.rolloutCorrection) || !has(self.algorithm.rolloutCorrection.mode) || "
    "self.algorithm.rolloutCorrection.mode != 'off'",
    message="minP and repetitionPenalty change the distribution the engines sample from, which "
    "the trainer does not score: they need algorithm.rolloutCorrection (tis or a mask), not off",
    check=lambda m: (
        (m.rollout.sampling.min_p == 0 and m.rollout.sampling.repetition_penalty == 1)
        or m.algorithm.rollout_correction.mode != "off"
    ),
    field="rollout.sampling",
)
_SPEC_RULES = (
    _EVAL_NEEDS_VAL_RULE,
    _VAL_FILES_UNUSED_RULE,
    _SHAPED_SAMPLING_RULE,
    _KL_REFERENCE_RULE,
    _MINI_BATCH_RULE,
    _SERVICE_REWARD_RULE,
    *TRACKING_SPEC_RULES,
    _OUTPUT_VOLUME_RULE,
    _OUTPUT_ON_VOLUME_RULE,
    _MOUNT_PATHS_RULE,
)


def _default_reward() -> RewardSpec:
    return RewardSpec(function="math_answer")


class LoRARLJobSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(*_SPEC_RULES))

    model: ModelSpec = Field(description="Base model.")
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA adapter settings.")
    algorithm: AlgorithmSpec = Field(
        default_factory=AlgorithmSpec, description="RL algorithm and loss."
    )
    optim: OptimSpec = Field(default_factory=OptimSpec, description="Optimizer.")
    data: DataSpec = Field(description="Prompt data.")
    reward: RewardSpec = Field(
        default_factory=_default_reward, description="How completions are scored."
    )
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Training loop.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Trainer pods.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout engine pods.")
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description="Restarts and lifetime.")
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec, description="Queueing and gang scheduling."
    )
    logging: LoggingSpec = Field(
        default_factory=LoggingSpec,
        description="Experiment trackers (TensorBoard, MLflow, W&B); credentials from Secrets "
        "only.",
    )

    _rules = enforce(*_SPEC_RULES)


__all__ = [
    "GROUP_ALGORITHMS",
    "RESERVED_ENV",
    "RESERVED_MOUNT_PATHS",
    "Algorithm",
    "EvalSpec",
    "LoRARLJobSpec",
    "RewardServiceSpec",
    "RewardSpec",
]
