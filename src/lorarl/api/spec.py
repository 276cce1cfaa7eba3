"""The LoRARLJob spec. Every field is documented: the CRD (and `kubectl explain`) is generated
from these models."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from lorarl.api.base import ApiModel
from lorarl.api.k8s import (
    DNS1123_LABEL,
    GPU_RESOURCE,
    EnvVar,
    LabelValue,
    ObjectName,
    ResourceRequirements,
    Toleration,
    VolumeClaim,
)
from lorarl.api.rules import Rule, enforce, rules_schema_extra

GROUP_ALGORITHMS = ("grpo", "dr_grpo", "dapo", "rloo")
Algorithm = Literal["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "ppo"]
Dtype = Literal["float32", "bfloat16", "float16"]

# Variables lorarl renders for every process; a user value would silently break the job's wiring.
RESERVED_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "NPROC_PER_NODE",
    "LORARL_JOB_NAME",
    "LORARL_CONFIG",
    "LORARL_SYNC_ADDR",
    "LORARL_SYNC_PORT",
    "LORARL_SYNC_WORLD_SIZE",
    "LORARL_SYNC_BACKEND",
    "LORARL_SYNC_RANK",
    "LORARL_ROLLOUT_ENDPOINTS",
    "LORARL_SIDECAR_ENDPOINTS",
    "LORARL_REWARD_ENDPOINT",
    "LORARL_ENGINE_URL",
    "LORARL_PROGRESS_PORT",
    "LORARL_SIDECAR_PORT",
)
_RESERVED_CEL = "[" + ", ".join(f"'{n}'" for n in RESERVED_ENV) + "]"


def _env_rule() -> Rule:
    return Rule(
        cel=f"self.env.all(e, !(e.name in {_RESERVED_CEL}))",
        message="must not set reserved variables (" + ", ".join(RESERVED_ENV) + ")",
        check=lambda m: all(e.name not in RESERVED_ENV for e in m.env),
        field="env",
    )


_ENV_VALUE_RULE = Rule(
    cel="self.env.all(e, has(e.value) != has(e.valueFrom))",
    message="each variable needs exactly one of value or valueFrom",
    check=lambda m: all((e.value is None) != (e.value_from is None) for e in m.env),
    field="env",
)


class ModelSpec(ApiModel):
    path: str = Field(
        min_length=1,
        description="Base model: a local folder (on `volume` in a cluster) holding a Hugging Face "
        "model in safetensors, or a hub id baked into the image.",
    )
    volume: VolumeClaim | None = Field(
        default=None, description="PersistentVolumeClaim the model lives on, mounted read-only."
    )
    dtype: Dtype = Field(
        default="bfloat16", description="Weights dtype for training and rollout (float32 on CPU)."
    )
    trust_remote_code: bool = Field(
        default=False, description="Allow model code from the model folder (off: safer)."
    )


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
        default=32.0, gt=0, description="LoRA alpha; the update is scaled by alpha/r."
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


class KLSpec(ApiModel):
    reference: Literal["base", "initialAdapter"] = Field(
        default="base",
        description="The KL reference policy: base (the base model, adapter disabled) or "
        "initialAdapter (the adapter at lora.adapterPath as loaded, kept frozen on the same "
        "base: no second model copy).",
    )
    coef: float = Field(
        default=0.0,
        ge=0,
        description="KL penalty coefficient against the base model (adapter disabled); 0 turns "
        "it off, as DAPO and Dr.GRPO recommend.",
    )
    estimator: Literal["k1", "k2", "k3", "low_var_kl", "mse"] = Field(
        default="k3",
        description="KL estimator (verl's names accepted: low_var_kl = k3, mse = k2). As a loss, "
        "k2/mse is the one whose gradient is the gradient of KL(pi || ref); k3 (low variance, "
        "non-negative) gives the gradient of KL(ref || pi) instead; k1's gradient is zero in "
        "expectation (the trainer warns). See docs/algorithms.md.",
    )


class RolloutCorrectionSpec(ApiModel):
    mode: Literal["tis", "mask-token", "mask-sequence", "off"] = Field(
        default="tis",
        description="Correction for the engines not sampling exactly the trainer's policy "
        "(other precision and kernels, or one-step-old weights), from the ratio rho = "
        "pi_trainer / pi_engine per token: tis (truncated importance sampling, the loss of each "
        "token weighted by min(rho, threshold), as verl and TRL), mask-token (drop tokens with "
        "rho outside [1/threshold, threshold]), mask-sequence (drop sequences whose "
        "geometric-mean rho is outside it) or off.",
    )
    threshold: float = Field(
        default=2.0, gt=1, le=1000, description="The cap (tis) or the mask bound on rho."
    )


class DynamicSamplingSpec(ApiModel):
    enabled: bool | None = Field(
        default=None,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal and refill. "
        "Default: on for dapo, off otherwise.",
    )
    max_rounds: int = Field(
        default=3, ge=1, le=32, description="Generation rounds per step before giving up refilling."
    )


_GROUP_SIZE_RULE = Rule(
    cel="!(self.name in ['grpo', 'dr_grpo', 'dapo', 'rloo']) || self.groupSize >= 2",
    message="must be at least 2 for group-based algorithms (grpo, dr_grpo, dapo, rloo)",
    check=lambda m: m.name not in GROUP_ALGORITHMS or m.group_size >= 2,
    field="groupSize",
)
_DYNAMIC_SAMPLING_RULE = Rule(
    cel="!has(self.dynamicSampling.enabled) || !self.dynamicSampling.enabled || "
    "self.groupSize >= 2",
    message="dynamic sampling needs groupSize of at least 2",
    check=lambda m: not m.dynamic_sampling.enabled or m.group_size >= 2,
    field="dynamicSampling",
)


class OverlongSpec(ApiModel):
    mask: bool | None = Field(
        default=None,
        description="Overlong filtering: completions cut at maxResponseTokens (finish reason "
        "'length') do not contribute to the loss. Default: off.",
    )
    soft_punishment: bool | None = Field(
        default=None,
        description="DAPO's soft overlong punishment: a completion longer than maxResponseTokens "
        "- bufferTokens gets a reward penalty growing linearly to penaltyFactor at "
        "maxResponseTokens. Default: on for dapo, off otherwise.",
    )
    buffer_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Length of the punishment buffer. Default: maxResponseTokens / 5 (DAPO: 4096 "
        "of 20480).",
    )
    penalty_factor: float = Field(
        default=1.0, gt=0, description="Penalty at maxResponseTokens (DAPO: 1)."
    )


_SUM_AGGS = ("seq-mean-token-sum", "seq-mean-token-sum-norm")
_NORM_LENGTH_RULE = Rule(
    cel="!has(self.lossNormLength) || (has(self.lossAggregation) ? "
    "self.lossAggregation in ['seq-mean-token-sum', 'seq-mean-token-sum-norm'] : "
    "self.name == 'dr_grpo')",
    message="applies to lossAggregation seq-mean-token-sum(-norm) only (dr_grpo's default)",
    check=lambda m: (
        m.loss_norm_length is None
        or (m.loss_aggregation in _SUM_AGGS if m.loss_aggregation else m.name == "dr_grpo")
    ),
    field="lossNormLength",
)
_OVERLONG_BUFFER_RULE = Rule(
    cel="!has(self.overlong.bufferTokens) || (has(self.overlong.softPunishment) ? "
    "self.overlong.softPunishment : self.name == 'dapo')",
    message="applies to the soft overlong punishment only (on by default for dapo)",
    check=lambda m: (
        m.overlong.buffer_tokens is None
        or (
            m.overlong.soft_punishment
            if m.overlong.soft_punishment is not None
            else m.name == "dapo"
        )
    ),
    field="overlong.bufferTokens",
)
_ALGORITHM_RULES = (
    _GROUP_SIZE_RULE,
    _DYNAMIC_SAMPLING_RULE,
    _NORM_LENGTH_RULE,
    _OVERLONG_BUFFER_RULE,
)


class AlgorithmSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(*_ALGORITHM_RULES))

    name: Algorithm = Field(
        default="grpo",
        description="grpo, dr_grpo (no std scaling, seq-mean-token-sum-norm), dapo (the DAPO "
        "recipe: clip-higher 0.28, dynamic sampling, token-mean, soft overlong punishment; each "
        "overridable), rloo, reinforce_pp or ppo.",
    )
    group_size: int = Field(default=8, ge=1, le=1024, description="Samples generated per prompt.")
    clip_ratio_low: float = Field(
        default=0.2, ge=0, le=1, description="Lower clip: ratio >= 1 - clipRatioLow."
    )
    clip_ratio_high: float | None = Field(
        default=None,
        ge=0,
        le=10,
        description="Upper clip: ratio <= 1 + clipRatioHigh. Default: 0.28 for dapo "
        "(clip-higher), 0.2 otherwise.",
    )
    dual_clip: float | None = Field(
        default=3.0,
        gt=1,
        description="Dual-clip bound c (verl's default 3): the loss of a negative-advantage token "
        "is capped at -A * c, so a token whose ratio exploded (stale or mismatched samples) "
        "cannot dominate the step. null turns it off.",
    )
    loss_aggregation: (
        Literal[
            "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
        ]
        | None
    ) = Field(
        default=None,
        description="How token losses become one number: token-mean (DAPO), seq-mean-token-mean "
        "(GRPO paper), seq-mean-token-sum, or seq-mean-token-sum-norm (Dr.GRPO: per-sequence "
        "sums divided by the constant lossNormLength). Default: seq-mean-token-sum-norm for "
        "dr_grpo, token-mean otherwise.",
    )
    loss_norm_length: int | None = Field(
        default=None,
        gt=0,
        description="The constant of seq-mean-token-sum-norm. Default: data.maxResponseTokens.",
    )
    overlong: OverlongSpec = Field(
        default_factory=OverlongSpec,
        description="Completions cut at maxResponseTokens: masking and DAPO's soft punishment.",
    )
    kl: KLSpec = Field(default_factory=KLSpec, description="KL penalty to the base model.")
    rollout_correction: RolloutCorrectionSpec = Field(
        default_factory=RolloutCorrectionSpec,
        description="Importance-sampling correction against the engines' logprobs (on: tis).",
    )
    entropy_coef: float = Field(default=0.0, ge=0, description="Entropy bonus coefficient.")
    dynamic_sampling: DynamicSamplingSpec = Field(
        default_factory=DynamicSamplingSpec, description="DAPO dynamic sampling."
    )
    ppo_epochs: int = Field(
        default=1, ge=1, le=16, description="Optimizer passes over each step's samples."
    )
    gamma: float = Field(default=1.0, ge=0, le=1, description="PPO discount factor.")
    lam: float = Field(default=0.95, ge=0, le=1, description="PPO GAE lambda.")

    _rules = enforce(*_ALGORITHM_RULES)


class OptimSpec(ApiModel):
    lr: float = Field(
        default=1e-5,
        gt=0,
        le=1,
        description="AdamW learning rate. LoRA wants about 10x the full fine-tuning rate "
        "(verl's LoRA guide, 'LoRA Without Regret'): 1e-5 where full RL uses 1e-6.",
    )
    betas: list[float] = Field(
        default_factory=lambda: [0.9, 0.999],
        min_length=2,
        max_length=2,
        description="AdamW betas.",
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup steps.")
    scheduler: Literal["constant", "cosine"] = Field(
        default="constant", description="Learning-rate schedule after warmup."
    )
    grad_clip: float = Field(default=1.0, gt=0, description="Max global gradient norm.")


class DataSpec(ApiModel):
    train_files: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1, description="Prompt files (.jsonl or .parquet)."
    )
    val_files: list[str] = Field(default_factory=list, description="Validation prompt files.")
    volume: VolumeClaim | None = Field(
        default=None, description="PersistentVolumeClaim holding the data files."
    )
    prompt_key: str = Field(
        default="prompt", min_length=1, description="Field with the prompt (text or chat list)."
    )
    answer_key: str = Field(
        default="answer", min_length=1, description="Field with the ground truth for the reward."
    )
    system_prompt: str | None = Field(
        default=None, description="System message prepended to every prompt."
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
    seed: int = Field(default=0, ge=0, description="Shuffle seed.")


class RewardServiceSpec(ApiModel):
    url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        description="An existing reward service (e.g. a KubeRay RayService); lorarl runs one "
        "itself when unset.",
    )
    replicas: int = Field(default=1, ge=1, le=64, description="Serve replicas per deployment.")
    max_replicas: int | None = Field(
        default=None, ge=1, description="Autoscaling upper bound (autoscaling off if unset)."
    )
    timeout_seconds: float = Field(default=60.0, gt=0, description="Timeout per scoring call.")
    max_retries: int = Field(default=3, ge=0, le=20, description="Retries before the step fails.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Reward pod resources."
    )


_ONE_REWARD_SOURCE = Rule(
    cel="(has(self.function) ? 1 : 0) + (has(self.entrypoint) ? 1 : 0) == 1",
    message="set exactly one of function or entrypoint",
    check=lambda m: (m.function is not None) + (m.entrypoint is not None) == 1,
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
        default_factory=dict, description="Keyword arguments for the reward function."
    )
    service: RewardServiceSpec | None = Field(
        default=None,
        description="Score through a Ray Serve reward service instead of inside the trainer.",
    )

    _rules = enforce(_ONE_REWARD_SOURCE)


class TrainingSpec(ApiModel):
    total_steps: int = Field(default=100, gt=0, le=10_000_000, description="RL steps to run.")
    prompts_per_step: int = Field(
        default=16, gt=0, le=65536, description="Prompts per step (each gets groupSize samples)."
    )
    mini_batch_size: int | None = Field(
        default=None,
        gt=0,
        description="Samples per optimizer update within a step (one update per step if unset).",
    )
    micro_batch_size: int = Field(
        default=4, gt=0, le=4096, description="Sequences per forward/backward on each rank."
    )
    checkpoint_interval: int = Field(
        default=50, gt=0, description="Save a checkpoint every N steps."
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
    seed: int = Field(default=42, ge=0, description="Seed for sampling and initialization.")
    off_policy_steps: int = Field(
        default=0,
        ge=0,
        le=1,
        description="1: the engines generate the next step's batch while this step trains, "
        "with weights one step old (generation no longer waits for training; the loss uses "
        "the engines' logprobs as the behavior policy). 0: every batch comes from the newest "
        "weights.",
    )


class FsdpSpec(ApiModel):
    reshard_after_forward: bool = Field(
        default=True,
        description="Free gathered parameters after forward (keep true with LoRA: PEFT's "
        "disable_adapter misbehaves otherwise).",
    )
    mixed_precision: bool = Field(
        default=True, description="bf16 parameters with fp32 reductions on GPU."
    )


class PodTemplateFields(ApiModel):
    image: str | None = Field(
        default=None,
        description="Container image; unset: lorarl's own (for rollout pods, the image of the "
        "chosen engine).",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Container resources."
    )
    node_selector: dict[str, LabelValue] = Field(default_factory=dict, description="Node selector.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations.")
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=128,
        description="Extra environment (secrets through valueFrom.secretKeyRef only).",
    )


# lorarl sets the GPU limit from gpusPerReplica; a user's own would clash with it.
_NO_GPU_RESOURCE = Rule(
    cel=f"!('{GPU_RESOURCE}' in self.resources.requests) && "
    f"!('{GPU_RESOURCE}' in self.resources.limits)",
    message=f"must not name {GPU_RESOURCE}: set gpusPerReplica instead",
    check=lambda m: (
        GPU_RESOURCE not in m.resources.requests and GPU_RESOURCE not in m.resources.limits
    ),
    field="resources",
)
_TRAINER_ENV_RULE = _env_rule()


class TrainerSpec(PodTemplateFields):
    model_config = ConfigDict(
        json_schema_extra=rules_schema_extra(_TRAINER_ENV_RULE, _ENV_VALUE_RULE, _NO_GPU_RESOURCE)
    )

    replicas: int = Field(default=1, ge=1, le=1024, description="Trainer nodes (pods).")
    gpus_per_replica: int = Field(
        default=1, ge=0, le=16, description="GPUs per trainer pod (0 trains on CPU)."
    )
    processes_per_replica: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="torchrun processes per pod; defaults to gpusPerReplica (1 on CPU).",
    )
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec, description="FSDP2 options.")

    _rules = enforce(_TRAINER_ENV_RULE, _ENV_VALUE_RULE, _NO_GPU_RESOURCE)


_TEMPERATURE_RULE = Rule(
    cel="self.temperature > 0",
    message="must be > 0 for training: RL needs sampled completions and the logprobs of the "
    "distribution they were sampled from (temperature 0 is greedy decoding)",
    check=lambda m: m.temperature > 0,
    field="temperature",
)


class SamplingSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_TEMPERATURE_RULE))

    temperature: float = Field(
        default=1.0,
        ge=0,
        le=10,
        description="Sampling temperature (> 0). The trainer scores softmax(logits / "
        "temperature), the distribution the engines sample from and report logprobs of.",
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(default=-1, ge=-1, description="Top-k (-1: off).")

    _rules = enforce(_TEMPERATURE_RULE)


_ROLLOUT_ENV_RULE = _env_rule()
_TP_RULE = Rule(
    cel="self.gpusPerReplica == 0 || self.gpusPerReplica % self.tensorParallelSize == 0",
    message="must divide gpusPerReplica",
    check=lambda m: m.gpus_per_replica == 0 or m.gpus_per_replica % m.tensor_parallel_size == 0,
    field="tensorParallelSize",
)
_TP_CPU_RULE = Rule(
    cel="self.gpusPerReplica > 0 || self.tensorParallelSize == 1",
    message="must be 1 when gpusPerReplica is 0",
    check=lambda m: m.gpus_per_replica > 0 or m.tensor_parallel_size == 1,
    field="tensorParallelSize",
)


class RolloutSpec(PodTemplateFields):
    model_config = ConfigDict(
        json_schema_extra=rules_schema_extra(
            _ROLLOUT_ENV_RULE, _ENV_VALUE_RULE, _TP_RULE, _TP_CPU_RULE, _NO_GPU_RESOURCE
        )
    )

    engine: Literal["sglang", "vllm"] = Field(
        default="sglang", description="Inference engine: sglang (GPU) or vllm (GPU and CPU)."
    )
    replicas: int = Field(default=1, ge=1, le=1024, description="Rollout engine pods.")
    gpus_per_replica: int = Field(default=1, ge=0, le=16, description="GPUs per rollout pod.")
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=16, description="Tensor parallel size of each engine."
    )
    sync_mode: Literal["merged", "adapter"] = Field(
        default="merged",
        description="merged: the sidecar merges W + s*B@A and pushes the weights; adapter: the "
        "engine serves the LoRA adapter directly.",
    )
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="Sampling params.")
    memory_fraction: float = Field(
        default=0.85, gt=0, le=1, description="Fraction of GPU memory the engine may take."
    )
    kv_cache_gib: int | None = Field(
        default=None, ge=1, description="KV cache size in GiB for CPU engines."
    )
    engine_args: list[str] = Field(
        default_factory=list, description="Extra engine command-line flags."
    )

    _rules = enforce(_ROLLOUT_ENV_RULE, _ENV_VALUE_RULE, _TP_RULE, _TP_CPU_RULE, _NO_GPU_RESOURCE)


class RunPolicy(ApiModel):
    backoff_limit: int = Field(
        default=3, ge=0, le=1000, description="Trainer group restarts before the job fails."
    )
    active_deadline_seconds: int | None = Field(
        default=None, gt=0, description="Fail the job (DeadlineExceeded) after this long."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, description="Delete the finished job after this long."
    )
    clean_pod_policy: Literal["All", "Running", "None"] = Field(
        default="Running",
        description="Pods to delete when the job finishes: Running (default) stops the pods "
        "still running and keeps finished ones for `kubectl logs`; All deletes every pod; None "
        "keeps them all.",
    )
    suspend: bool = Field(
        default=False, description="Delete the pods but keep checkpoints (Kueue sets this)."
    )


class SchedulingSpec(ApiModel):
    queue_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=DNS1123_LABEL,
        description="Kueue LocalQueue to admit the job through (a pod label value).",
    )
    gang: Literal["none", "scheduler-plugins", "volcano"] = Field(
        default="none", description="Gang-schedule all pods of the job with a PodGroup."
    )
    priority_class_name: ObjectName | None = Field(
        default=None, description="PriorityClass for the job's pods."
    )


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
_KL_REFERENCE_RULE = Rule(
    cel="self.algorithm.kl.reference != 'initialAdapter' || has(self.lora.adapterPath)",
    message="initialAdapter needs lora.adapterPath (the adapter training starts from)",
    check=lambda m: m.algorithm.kl.reference != "initialAdapter" or bool(m.lora.adapter_path),
    field="algorithm.kl.reference",
)
_SPEC_RULES = (
    _KL_REFERENCE_RULE,
    _MINI_BATCH_RULE,
    _SERVICE_REWARD_RULE,
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

    _rules = enforce(*_SPEC_RULES)
