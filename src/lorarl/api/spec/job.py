"""The LoRARLJob spec. Every field is documented: the CRD (and `kubectl explain`) is generated
from these models. The algorithm, critic, reward, training and pod sections live in their own
modules; the names other modules import from here are re-exported (`__all__`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from lorarl.api.base import MAX_INT, ApiModel
from lorarl.api.rules import Rule, enforce, rules_schema_extra
from lorarl.api.spec.agent import AGENT_SPEC_RULES, AgentSpec
from lorarl.api.spec.algorithm import GROUP_ALGORITHMS, Algorithm, AlgorithmSpec, OptimSpec
from lorarl.api.spec.critic import CRITIC_SPEC_RULES, CriticSpec
from lorarl.api.spec.environment import (
    DEFAULT_MAX_RESPONSE_TOKENS,
    ENVIRONMENT_SPEC_RULES,
    EnvironmentSpec,
)
from lorarl.api.spec.k8s import SecretKeySelector, VolumeClaim
from lorarl.api.spec.lora import LoraSpec
from lorarl.api.spec.placement import PLACEMENT_SPEC_RULES
from lorarl.api.spec.reward import RewardServiceSpec, RewardSpec
from lorarl.api.spec.tracking import TRACKING_SPEC_RULES, LoggingSpec
from lorarl.api.spec.training import EvalSpec, TrainingSpec
from lorarl.api.spec.workloads import (
    RESERVED_ENV,
    RolloutSpec,
    RunPolicy,
    SchedulingSpec,
    TrainerSpec,
)

Dtype = Literal["float32", "bfloat16", "float16"]


# A hub id ("gpt2", "org/name") is at most two plain parts; a folder is absolute, starts with
# "." or "~", or has more parts. lorarl.hub.HUB_ID_PATTERN is the same (a test keeps them equal).
HUB_ID_PATTERN = r"^[^./~][^/]*(/[^/]*)?$"


def is_hub_id(path: str) -> bool:
    return re.match(HUB_ID_PATTERN, path) is not None


def _hub_only(field: str) -> Rule:
    return Rule(
        cel=f"!has(self.{field}) || self.path.matches('{HUB_ID_PATTERN}')",
        message="applies to a hub id only, and path is a folder",
        check=lambda m: getattr(m, field) is None or is_hub_id(m.path),
        field=field,
    )


_HUB_ONLY_RULES = (_hub_only("revision"), _hub_only("hub"))


class HubSpec(ApiModel):
    endpoint: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description="Hub to download from (HF_ENDPOINT): a mirror or a private hub. Default: "
        "huggingface.co.",
    )
    token_secret: SecretKeySelector | None = Field(
        default=None,
        description="Secret key holding the hub token (HF_TOKEN) for gated or private models; "
        "only the download init container sees it. Locally: HF_TOKEN or `hf auth login`.",
    )


class ModelSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(*_HUB_ONLY_RULES))

    path: str = Field(
        min_length=1,
        max_length=1024,
        description="Base model: a folder holding a Hugging Face model in safetensors (on "
        "`volume` in a cluster), or a hub id (`org/name`). A hub id is downloaded once into a "
        "cache (locally the user's hub cache; in a cluster `volume`, else one per pod) by an "
        "init container before the pods start; status.model.revision records the commit.",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        max_length=255,
        pattern=r"^[A-Za-z0-9][-A-Za-z0-9_./]*$",
        description="Branch, tag or commit of a hub id (default main). Every pod of the job "
        "loads the commit it resolves to first (status.model.revision).",
    )
    hub: HubSpec | None = Field(
        default=None, description="Where a hub id comes from, and the token it needs."
    )
    volume: VolumeClaim | None = Field(
        default=None,
        description="PersistentVolumeClaim the model lives on, mounted read-only. With a hub "
        "id: the hub cache the pods share (the download init container writes it).",
    )
    dtype: Dtype = Field(
        default="bfloat16",
        description="Weights dtype for training and rollout. bfloat16 suits GPUs and CPUs with "
        "AVX512-BF16 or AMX; on other CPUs bfloat16 is emulated and float32 is faster.",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Allow model code from the model folder, in the trainer and the engines "
        "(off: safer).",
    )

    _rules = enforce(*_HUB_ONLY_RULES)

    @property
    def from_hub(self) -> bool:
        return is_hub_id(self.path)


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
        default=DEFAULT_MAX_RESPONSE_TOKENS, gt=0, le=131072, description="Completion length limit."
    )
    shuffle: bool = Field(default=True, description="Shuffle prompts every epoch.")
    seed: int = Field(default=0, ge=0, le=MAX_INT, description="Shuffle seed.")

    _rules = enforce(_SEED_WITHOUT_SHUFFLE_RULE)


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
# lorarl's reward pod runs lorarl's image and mounts no claim: the user's code can only reach it
# through reward.configMap.
_SERVICE_REWARD_RULE = Rule(
    cel="!has(self.reward.service) || !has(self.reward.entrypoint) || "
    "has(self.reward.service.url) || has(self.reward.configMap)",
    message="a module:function reward can only be served by your own service (set service.url); "
    "lorarl's reward service runs lorarl's image and serves your code only as a file in "
    "reward.configMap",
    check=lambda m: (
        m.reward.service is None
        or m.reward.entrypoint is None
        or m.reward.service.url is not None
        or m.reward.config_map is not None
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
    ("has(self.reward) && has(self.reward.configMap)", "self.reward.configMap.mountPath"),
    ("has(self.agent) && has(self.agent.configMap)", "self.agent.configMap.mountPath"),
    ("has(self.rollout) && has(self.rollout.cacheVolume)", "self.rollout.cacheVolume.mountPath"),
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
    agent = m.agent.config_map if m.agent is not None else None
    mounts = (
        m.model.volume,
        m.data.volume,
        m.training.volume,
        m.reward.config_map,
        agent,
        m.rollout.cache_volume,
    )
    return [c.mount_path for c in mounts if c is not None]


# The API server refuses a Pod whose container mounts two volumes at one path.
_MOUNT_PATHS_RULE = Rule(
    cel=_mount_paths_cel(),
    message="model.volume, data.volume, training.volume, reward.configMap, agent.configMap and "
    "rollout.cacheVolume need distinct "
    "mountPaths, none of " + ", ".join(RESERVED_MOUNT_PATHS) + " (lorarl mounts those)",
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
# vLLM reports the logprobs of the penalized distribution it sampled from (SGLang too: the
# penalty is applied to the logits it reports); the trainer scores softmax(z / T). Only an
# importance-sampling correction weighs that gap (the support is the same, so the weight is
# unbiased); without one the update would treat penalized samples as the policy's own.
# top-p / top-k / min-p are refused outright (SamplingSpec): a truncated support cannot be
# weighed back.
_SHAPED_SAMPLING_RULE = Rule(
    cel="!has(self.rollout) || !has(self.rollout.sampling) || "
    "!has(self.rollout.sampling.repetitionPenalty) || "
    "self.rollout.sampling.repetitionPenalty == 1.0 || !has(self.algorithm) || "
    "!has(self.algorithm.rolloutCorrection) || !has(self.algorithm.rolloutCorrection.mode) || "
    "self.algorithm.rolloutCorrection.mode != 'off'",
    message="needs algorithm.rolloutCorrection (tis or a mask), not off: the penalty changes the "
    "distribution the engines sample from, which the trainer does not score",
    check=lambda m: (
        m.rollout.sampling.repetition_penalty == 1 or m.algorithm.rollout_correction.mode != "off"
    ),
    field="rollout.sampling.repetitionPenalty",
)
# The engines reserve LoRA slots of lora.rank when they start, before any adapter is read; in a
# cluster nothing that renders the pods can read the adapter (it sits on the trainer's volume), so
# the adapter's r cannot size them. Locally the plan reads it (api/spec/lora.py `values_here`).
_ADAPTER_RANK_RULE = Rule(
    cel="!has(self.lora) || !has(self.lora.adapterPath) || has(self.lora.rank) || "
    "!has(self.rollout) || !has(self.rollout.syncMode) || self.rollout.syncMode != 'adapter'",
    message="required with lora.adapterPath and rollout.syncMode adapter on a cluster: the "
    "engines reserve LoRA slots of this rank before the adapter is read; set it to the "
    "adapter's r",
    check=lambda m: (
        m.lora.adapter_path is None or m.lora.rank is not None or m.rollout.sync_mode != "adapter"
    ),
    field="lora.rank",
    cluster=True,
)
_SPEC_RULES = (
    _EVAL_NEEDS_VAL_RULE,
    _VAL_FILES_UNUSED_RULE,
    _SHAPED_SAMPLING_RULE,
    _KL_REFERENCE_RULE,
    _MINI_BATCH_RULE,
    _SERVICE_REWARD_RULE,
    *TRACKING_SPEC_RULES,
    *CRITIC_SPEC_RULES,
    *ENVIRONMENT_SPEC_RULES,
    *AGENT_SPEC_RULES,
    *PLACEMENT_SPEC_RULES,
    _OUTPUT_VOLUME_RULE,
    _OUTPUT_ON_VOLUME_RULE,
    _MOUNT_PATHS_RULE,
    _ADAPTER_RANK_RULE,
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
    optim: OptimSpec = Field(
        default_factory=OptimSpec, description="Optimizer (the actor's, with ppo)."
    )
    critic: CriticSpec | None = Field(
        default=None,
        description="ppo's value model: a second LoRA adapter on the same base with a value "
        "head, trained by its own optimizer. ppo only; unset with ppo means every default.",
    )
    data: DataSpec = Field(description="Prompt data.")
    reward: RewardSpec = Field(
        default_factory=_default_reward, description="How completions are scored."
    )
    environment: EnvironmentSpec | None = Field(
        default=None,
        description="Multi-turn rollouts: an environment answers each model turn (tool results, "
        "new messages) until the episode ends. Unset: one completion per sample.",
    )
    agent: AgentSpec | None = Field(
        default=None,
        description="Episodes run by your own agent function through an OpenAI-compatible "
        "endpoint on trainer rank 0; every model call it makes is recorded token-exactly and "
        "trained with the episode's reward. Exclusive with environment.",
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
    "CriticSpec",
    "EnvironmentSpec",
    "EvalSpec",
    "LoRARLJobSpec",
    "LoraSpec",
    "RewardServiceSpec",
    "RewardSpec",
    "TrainingSpec",
]
