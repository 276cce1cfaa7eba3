"""The pod-shaped sections of the LoRARLJob spec: trainer and rollout pods, sampling, run policy
and scheduling, and the environment variables lorarl reserves for its own wiring."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from lorarl.api.base import MAX_SECONDS, ApiModel
from lorarl.api.rules import Rule, crd_only, enforce, rules_schema_extra
from lorarl.api.spec.k8s import (
    DNS1123_LABEL,
    GPU_RESOURCE,
    EnvVar,
    LabelValue,
    ObjectName,
    ResourceRequirements,
    Toleration,
    VolumeClaim,
)
from lorarl.api.spec.placement import COLOCATED_MEMORY_FRACTION, COLOCATED_PROCESSES_ENV, Placement
from lorarl.engines.flags import overriding_arg

# The per-job secrets, delivered by reference (a Secret in a cluster, generated per run locally):
# the engines' API key, and the key that authenticates the weight-sync channel's announcements.
ENGINE_API_KEY_ENV = "LORARL_ENGINE_API_KEY"
SYNC_KEY_ENV = "LORARL_SYNC_KEY"
# The job's identity (its metadata.uid in a cluster, a run directory's own id locally): stamped
# into every checkpoint, so a trainer never resumes from or deletes another job's.
JOB_UID_ENV = "LORARL_JOB_UID"

# Variables lorarl renders for every process; a user value would silently break the job's wiring
# (or, for the keys, let a manifest pick the secret that guards the job's own channels).
RESERVED_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "NPROC_PER_NODE",
    "LORARL_JOB_NAME",
    JOB_UID_ENV,
    "LORARL_CONFIG",
    COLOCATED_PROCESSES_ENV,
    "LORARL_SYNC_ADDR",
    "LORARL_SYNC_PORT",
    "LORARL_SYNC_WORLD_SIZE",
    "LORARL_SYNC_BACKEND",
    "LORARL_ROLLOUT_INDEX",
    "LORARL_ADVERTISED_ENGINE_URL",
    "LORARL_ADVERTISED_SIDECAR_URL",
    "LORARL_ROLLOUT_ENDPOINTS",
    "LORARL_SIDECAR_ENDPOINTS",
    "LORARL_REWARD_ENDPOINT",
    "LORARL_ENGINE_URL",
    "LORARL_PROGRESS_PORT",
    "LORARL_SIDECAR_PORT",
    ENGINE_API_KEY_ENV,
    SYNC_KEY_ENV,
    "VLLM_API_KEY",
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


# With resharding off, PEFT's disable_adapter (the KL reference, the base model's logprobs) flips
# requires_grad on the unsharded copies and leaves the real sharded LoRA weights frozen
# (docs/architecture.md#measured-facts), so only true is accepted.
_RESHARD_RULE = Rule(
    cel="!has(self.reshardAfterForward) || self.reshardAfterForward",
    message="false is not supported with LoRA: PEFT's disable_adapter would freeze the sharded "
    "LoRA weights; leave it true",
    check=lambda m: m.reshard_after_forward,
    field="reshardAfterForward",
)


class FsdpSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_RESHARD_RULE))

    reshard_after_forward: bool = Field(
        default=True,
        description="Free gathered parameters after forward. Only true is accepted: with LoRA, "
        "PEFT's disable_adapter misbehaves otherwise.",
    )
    mixed_precision: bool = Field(
        default=True,
        description="bf16 compute over fp32 LoRA weights: FSDP2's bf16 parameters with fp32 "
        "reductions on GPU; on CPU, when model.dtype is bfloat16, the LoRA layers run in bf16 "
        "(autocast) instead of casting their input up to fp32.",
    )
    offload_params: bool = Field(
        default=False,
        description="Keep the sharded parameters (the frozen base and LoRA), their gradients and "
        "the optimizer state in pinned host memory; each layer is copied to the GPU for its "
        "forward and backward (FSDP2's CPUOffloadPolicy; verl's param_offload and "
        "optimizer_offload together). Frees the GPU of the base's shard at the cost of host "
        "bandwidth. GPU trainers only (gpusPerReplica > 0).",
    )

    _rules = enforce(_RESHARD_RULE)


class PodTemplateFields(ApiModel):
    image: str | None = Field(
        default=None,
        description="Container image; unset: lorarl's own (for rollout pods, the image of the "
        "chosen engine).",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Container resources."
    )
    # Bounded (maps and lists alike) so the CRD's CEL rules fit the API server's cost budget.
    node_selector: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=32, description="Node selector."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Tolerations."
    )
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


# Rank i of a pod trains on cuda:i: fewer ranks than GPUs leave GPUs idle, more find none.
_PROCESSES_RULE = Rule(
    cel="self.gpusPerReplica == 0 || !has(self.processesPerReplica) || "
    "self.processesPerReplica == self.gpusPerReplica",
    message="must equal gpusPerReplica on GPU (one rank per GPU); leave it unset there",
    check=lambda m: (
        m.gpus_per_replica == 0
        or m.processes_per_replica is None
        or m.processes_per_replica == m.gpus_per_replica
    ),
    field="processesPerReplica",
)
# On CPU the parameters are in host memory already: offloading them would be accepted and do
# nothing.
_OFFLOAD_GPU_RULE = Rule(
    cel="self.gpusPerReplica > 0 || !has(self.fsdp) || !has(self.fsdp.offloadParams) || "
    "!self.fsdp.offloadParams",
    message="needs GPU trainers (gpusPerReplica > 0): on CPU the parameters are already in "
    "host memory",
    check=lambda m: m.gpus_per_replica > 0 or not m.fsdp.offload_params,
    field="fsdp.offloadParams",
)
_TRAINER_RULES = (
    _TRAINER_ENV_RULE,
    _ENV_VALUE_RULE,
    _NO_GPU_RESOURCE,
    _PROCESSES_RULE,
    _OFFLOAD_GPU_RULE,
)


class TrainerSpec(PodTemplateFields):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(*_TRAINER_RULES))

    replicas: int = Field(default=1, ge=1, le=1024, description="Trainer nodes (pods).")
    gpus_per_replica: int = Field(
        default=1, ge=0, le=16, description="GPUs per trainer pod (0 trains on CPU)."
    )
    processes_per_replica: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="torchrun processes per pod: gpusPerReplica on GPU (the default), any "
        "number on CPU (default 1).",
    )
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec, description="FSDP2 options.")
    activation_checkpointing: bool | None = Field(
        default=None,
        description="Recompute each decoder layer in the backward instead of keeping its "
        "activations (verl's enable_gradient_checkpointing, SkyRL's gradient_checkpointing): "
        "the update's activation memory drops to about one hidden state per layer and token, "
        "for about one more forward of compute. Unset: on for GPU trainers, off on CPU.",
    )

    _rules = enforce(*_TRAINER_RULES)


_TEMPERATURE_RULE = Rule(
    cel="self.temperature > 0",
    message="must be > 0 for training: RL needs sampled completions and the logprobs of the "
    "distribution they were sampled from (temperature 0 is greedy decoding)",
    check=lambda m: m.temperature > 0,
    field="temperature",
)
# Truncation filters cannot be made exact: the engines sample from the kept tokens only, vLLM
# reports logprobs of that truncated, renormalized distribution and SGLang those of the full one,
# while the trainer scores the full softmax(z / T). Every ratio (or, with SGLang, the sampling
# itself) would be off by the kept mass: with tis a hidden learning-rate cut, with a mask most
# tokens dropped (docs/algorithms.md#sampling-and-the-logprobs-the-trainer-compares).
_TRUNCATION = (
    "truncates the distribution the engines sample from, and the trainer scores the full "
    "softmax(logits / temperature)"
)
_TOP_P_RULE = Rule(
    cel="self.topP == 1.0",
    message=f"must be 1 for training: top-p {_TRUNCATION} (evals may use training.eval.topP)",
    check=lambda m: m.top_p == 1,
    field="topP",
)
_TOP_K_RULE = Rule(
    cel="self.topK <= 0",
    message=f"must be -1 (off) for training: top-k {_TRUNCATION}",
    check=lambda m: m.top_k <= 0,
    field="topK",
)
_MIN_P_RULE = Rule(
    cel="self.minP == 0.0",
    message=f"must be 0 for training: min-p {_TRUNCATION} (evals may use training.eval.minP)",
    check=lambda m: m.min_p == 0,
    field="minP",
)
_SAMPLING_RULES = (_TEMPERATURE_RULE, _TOP_P_RULE, _TOP_K_RULE, _MIN_P_RULE)


class SamplingSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(*_SAMPLING_RULES))

    temperature: float = Field(
        default=1.0,
        ge=0,
        le=10,
        description="Sampling temperature (> 0). The trainer scores softmax(logits / "
        "temperature), the distribution the engines sample from and report logprobs of.",
    )
    top_p: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Nucleus sampling mass: 1 only (the trainer scores the full distribution; "
        "training.eval.topP may be lower).",
    )
    top_k: int = Field(
        default=-1,
        ge=-1,
        le=1_048_576,
        description="Top-k: -1 or 0 (off) only (the trainer scores the full distribution).",
    )
    min_p: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Min-p: 0 (off) only (the trainer scores the full distribution; "
        "training.eval.minP may be set).",
    )
    repetition_penalty: float = Field(
        default=1.0,
        gt=0,
        le=2,
        description="Repetition penalty on tokens already in the prompt or completion (1: off; "
        "both engines take (0, 2]); other than 1 needs algorithm.rolloutCorrection on.",
    )
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list,
        max_length=32,
        description="Strings that end a completion (finish reason stop). The text the reward "
        "sees leaves the stop string out; the trained tokens keep the tokens that formed it.",
    )

    _rules = enforce(*_SAMPLING_RULES)


_ROLLOUT_ENV_RULE = _env_rule()
# A rollout pod runs one engine (no data parallelism inside a pod): GPUs beyond its
# tensor-parallel group would sit idle.
_TP_RULE = Rule(
    cel="self.gpusPerReplica == 0 || self.gpusPerReplica == self.tensorParallelSize",
    message="must equal gpusPerReplica: each rollout pod runs one engine over all its GPUs "
    "(more engines: more replicas)",
    check=lambda m: m.gpus_per_replica == 0 or m.gpus_per_replica == m.tensor_parallel_size,
    field="tensorParallelSize",
)
_TP_CPU_RULE = Rule(
    cel="self.gpusPerReplica > 0 || self.tensorParallelSize == 1",
    message="must be 1 when gpusPerReplica is 0",
    check=lambda m: m.gpus_per_replica > 0 or m.tensor_parallel_size == 1,
    field="tensorParallelSize",
)

# Each engine memory knob reaches one kind of engine only; elsewhere it would be ignored.
DEFAULT_MEMORY_FRACTION = 0.85
_MEMORY_FRACTION_RULE = Rule(
    cel=f"!has(self.memoryFraction) || self.memoryFraction == {DEFAULT_MEMORY_FRACTION} || "
    "self.gpusPerReplica > 0",
    message="applies to GPU engines only (gpusPerReplica > 0); a CPU engine's KV cache is "
    "kvCacheGib",
    check=lambda m: m.memory_fraction == DEFAULT_MEMORY_FRACTION or m.gpus_per_replica > 0,
    field="memoryFraction",
)
_KV_CACHE_RULE = Rule(
    cel="!has(self.kvCacheGib) || (self.engine == 'vllm' && self.gpusPerReplica == 0)",
    message="applies to vLLM on CPU only (engine vllm, gpusPerReplica 0); a GPU engine's KV "
    "cache is sized by memoryFraction",
    check=lambda m: m.kv_cache_gib is None or (m.engine == "vllm" and m.gpus_per_replica == 0),
    field="kvCacheGib",
)
# The SGLang command and image are GPU builds (no CPU device flag is planned): a CPU SGLang pod
# would fail at engine start instead of being refused here.
_SGLANG_GPU_RULE = Rule(
    cel="self.engine != 'sglang' || self.gpusPerReplica > 0",
    message="sglang runs on GPUs here (gpusPerReplica of at least 1); use engine vllm for CPU "
    "engines",
    check=lambda m: m.engine != "sglang" or m.gpus_per_replica > 0,
    field="gpusPerReplica",
)
# The engines write their compile caches there; a read-only claim would fail the first write.
_CACHE_WRITABLE_RULE = Rule(
    cel="!has(self.cacheVolume) || !has(self.cacheVolume.readOnly) || !self.cacheVolume.readOnly",
    message="must be false: the engines write their compile caches to this claim",
    check=lambda m: m.cache_volume is None or not m.cache_volume.read_only,
    field="cacheVolume.readOnly",
)

_ROLLOUT_RULES = (
    _ROLLOUT_ENV_RULE,
    _CACHE_WRITABLE_RULE,
    _ENV_VALUE_RULE,
    _TP_RULE,
    _TP_CPU_RULE,
    _SGLANG_GPU_RULE,
    _NO_GPU_RESOURCE,
    _MEMORY_FRACTION_RULE,
    _KV_CACHE_RULE,
)


class SyncCheckSpec(ApiModel):
    enabled: bool = Field(
        default=True,
        description="The stale-policy guard: before a replica generates from a new weight "
        "version, its engine answers the prompt logprobs of a fixed probe sequence (in adapter "
        "mode, as the versioned adapter) and they are compared with the trainer's for that "
        "version. A replica that fails is re-synced; failing again stops the job with its name.",
    )
    tolerance: float | None = Field(
        default=None,
        gt=0,
        le=10,
        description="Mean |engine - trainer| logprob per probe token allowed. Unset: 0.002 for "
        "float32 models, 0.1 for bfloat16/float16 (the engine-trainer gap on identical weights "
        "is ~1e-5 and ~1e-2).",
    )


class RolloutSpec(PodTemplateFields):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(*_ROLLOUT_RULES))

    engine: Literal["sglang", "vllm"] = Field(
        default="sglang",
        description="Inference engine: sglang (GPU only) or vllm (GPU and CPU).",
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Rollout engines: one pod each (separate), or trainer.replicas (colocated).",
    )
    placement: Placement = Field(
        default="separate",
        description="separate: engines in rollout pods of their own. colocated: each trainer pod "
        "also runs one engine and its sync sidecar on the same devices, generation and the "
        "update taking turns (on GPUs the engine releases its memory for the update); "
        "replicas and gpusPerReplica then equal the trainer's, and the trainer's image, "
        "resources, nodeSelector, tolerations and env shape the pod.",
    )
    gpus_per_replica: int = Field(default=1, ge=0, le=16, description="GPUs per rollout pod.")
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=16,
        description="Tensor parallel size of each engine: gpusPerReplica on GPU (one engine per "
        "pod), 1 on CPU.",
    )
    sync_mode: Literal["merged", "adapter"] = Field(
        default="merged",
        description="merged: the sidecar merges W + s*B@A and pushes the weights; adapter: the "
        "engine serves the LoRA adapter directly.",
    )
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="Sampling params.")
    sync_check: SyncCheckSpec = Field(
        default_factory=SyncCheckSpec,
        description="Checks that every engine serves the weights the trainer published.",
    )
    memory_fraction: float = Field(
        default=DEFAULT_MEMORY_FRACTION,
        gt=0,
        le=1,
        description="Fraction of GPU memory the engine may take (GPU engines only). Left at "
        f"{DEFAULT_MEMORY_FRACTION} with placement colocated, the engine takes "
        f"{COLOCATED_MEMORY_FRACTION}: the trainer needs the rest.",
    )
    kv_cache_gib: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="KV cache size in GiB of a vLLM CPU engine (1 if unset); GPU engines use "
        "memoryFraction instead.",
    )
    engine_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list,
        max_length=128,
        description="Extra engine command-line flags. Flags lorarl sets (API key, host, port, "
        "model, served name, logprob mode, LoRA serving, and those mirroring spec fields such as "
        "--dtype or --seed) cannot be overridden, nor abbreviated, and --config is refused.",
    )
    cache_volume: VolumeClaim | None = Field(
        default=None,
        description="PersistentVolumeClaim for the engines' compile caches (vLLM's cache root, "
        "torch Inductor's and Triton's kernels), mounted writable on every engine of the job: "
        "an engine that restarts, is rescheduled or is added reuses what an earlier one "
        "inspected and compiled instead of doing it again. The entries are keyed by what they "
        "were made from, so jobs may share a claim; engines on several nodes need a "
        "ReadWriteMany claim. Cluster only: a local run shares the user's cache (~/.cache/lorarl).",
    )
    preemptible: bool = Field(
        default=False,
        description="Rollout pods may run on spot/preemptible nodes: they tolerate the GKE and "
        "AKS spot taints (added to tolerations) and carry the label lorarl.dev/preemptible; "
        "nodeSelector picks the pool. A preempted pod is recreated alone (the trainer keeps "
        "going) and counted in status.rolloutPreemptions, never against backoffLimit.",
    )

    _rules = enforce(*_ROLLOUT_RULES)

    @model_validator(mode="after")
    def _no_managed_flags(self, info: ValidationInfo) -> RolloutSpec:
        """Python only (argparse's prefix matching is beyond a CEL rule's cost budget): the
        webhook and `lorarl validate` refuse it, and the plan refuses it again."""
        if crd_only(info):
            return self
        cpu = self.gpus_per_replica == 0
        bad = overriding_arg(self.engine, self.engine_args, cpu=cpu)
        if bad is None:
            return self
        message = (
            f"must not override or abbreviate a flag lorarl sets for {self.engine} (the API key, "
            "address, model, LoRA serving; the rest mirror spec fields: set those instead)"
        )
        raise PydanticCustomError(
            "rule", "{message}", {"message": message, "field": "engineArgs", "value": bad}
        )


class RunPolicy(ApiModel):
    backoff_limit: int = Field(
        default=3, ge=0, le=1000, description="Trainer group restarts before the job fails."
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        gt=0,
        le=MAX_SECONDS,
        description="Fail the job (DeadlineExceeded) after this long.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, le=MAX_SECONDS, description="Delete the finished job after this long."
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


# system-node-critical and system-cluster-critical outrank every workload and are Kubernetes'
# own; the operator's allow-list (the chart's webhook.allowedPriorityClasses) limits the rest.
_SYSTEM_PRIORITY_RULE = Rule(
    cel="!has(self.priorityClassName) || !self.priorityClassName.startsWith('system-')",
    message="system-* PriorityClasses are reserved for cluster components",
    check=lambda m: not (m.priority_class_name or "").startswith("system-"),
    field="priorityClassName",
)


class SchedulingSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_SYSTEM_PRIORITY_RULE))

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
        default=None,
        description="PriorityClass for the job's pods: one the operator allows (its admin lists "
        "them in the chart's webhook.allowedPriorityClasses; none by default), never system-*.",
    )

    _rules = enforce(_SYSTEM_PRIORITY_RULE)
