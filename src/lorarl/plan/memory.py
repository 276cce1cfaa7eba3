"""The memory plan: per trainer GPU and per engine GPU, what a job holds, from the model's
config.json alone (no weight is read) and the job spec.

Trainer (per rank; FSDP2 shards every parameter over all trainer ranks,
`trainer/model/parallel.py`):
- base weights: the frozen base in `model.dtype`, sharded over the FSDP world;
- gathered units: the unsharded parameters FSDP2 holds at once in the compute dtype: the root
  unit (embeddings, final norm, LM head) for the whole forward plus two decoder layers (the one
  computing and the one prefetched);
- LoRA parameters, their gradients and AdamW's two moments: all fp32 and sharded (PEFT keeps the
  adapter in fp32; FSDP2's mixed precision casts a bf16 copy per use, so there is no separate fp32
  master copy); PPO adds the critic adapter and its value head;
- activations of the largest micro-batch (`microBatchSize` x (maxPromptTokens +
  maxResponseTokens), cut by `maxTokensPerMicroBatch`): per decoder layer and token, what
  autograd keeps for a Llama/Qwen-style block with SDPA attention (no s^2 scores):
  the two RMSNorm inputs in fp32 (HF norms upcast), and in the compute dtype the two norm
  outputs, the rotated q and k, v, the attention output and its contiguous copy for o_proj, the
  MLP's gate, up, SiLU and product (4 x intermediate), and each LoRA A output (the rank);
  with activation checkpointing: each layer's input plus one layer recomputed in the backward
  (the backward frees what it has used as it goes: measured, its gradients add no more than
  the forward left);
- logits: only the response positions are computed (`logits_to_keep`), held with their gradient
  (`losses.chunked_logprobs` keeps the logits and allocates their gradient; its fp32 temporaries
  are `CHUNK_ROWS` positions at a time).

With `trainer.fsdp.offloadParams` the base shard, LoRA, gradients and optimizer state move to
pinned host memory; the GPU keeps the gathered units, activations and logits.

Engine (per GPU): the weights over tensor-parallel ranks and the KV cache that fits in
`rollout.memoryFraction` of the GPU (vLLM's gpu_memory_utilization, SGLang's mem_fraction_static);
a vLLM CPU engine's cache is `kvCacheGib` of host memory. Colocated GPU engines sleep during
the update (`trainer/fleet/engine_memory.py`), so the trainer's update peak must fit the whole
GPU and its resident state must fit beside the awake engine's fraction.

The estimate is checked against measured peaks in bench/memory_plan.py (docs/memory.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from lorarl.api.resource import LoRARLJob

GIB = 1024**3
MIB = 1024**2
DEFAULT_GPU_MEMORY = 80 * GIB
# `trainer/model/logprobs.py` CHUNK_ROWS (kept here without importing torch); a test pins them
# equal.
CHUNK_ROWS = 256
# Full-vocabulary fp32 temporaries per chunk in the logprob backward: the upcast logits, p and
# the gradient chunk.
CHUNK_TEMPORARIES = 3
GATHERED_LAYERS = 2  # FSDP2: the layer computing and the one prefetched
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: sizes from config.json, parameter counts from its
    module tree on the meta device (or given directly, as in tests)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int  # the base model's parameters
    layer_params: int  # one decoder layer's
    lora_params: int  # the actor adapter's
    lora_ranks_per_layer: int  # sum of the ranks of the adapted modules of one layer
    critic_params: int = 0  # ppo: the critic adapter and its value head

    @property
    def root_params(self) -> int:
        return self.params - self.layers * self.layer_params


@dataclass(frozen=True)
class Settings:
    """The job's memory-relevant choices, resolved (tests and what-ifs replace fields)."""

    world: int  # trainer ranks FSDP2 shards over
    gpu: bool  # GPU trainers
    weight_bytes: int  # model.dtype
    compute_bytes: int  # the forward's dtype
    rows: int  # sequences in the largest micro-batch
    seq: int  # their padded length
    response: int  # maxResponseTokens
    checkpointing: bool
    offload: bool
    tensor_parallel: int
    engine_gpu: bool
    memory_fraction: float
    kv_cache_bytes: int  # CPU engines
    colocated: bool


@dataclass(frozen=True)
class TrainerMemory:
    base_weights: int
    gathered_units: int
    lora_params: int
    lora_grads: int
    optimizer: int
    activations: int
    activations_checkpointed: int
    activations_full: int
    logits: int
    host_offloaded: int  # on the host with offload (0 without)

    @property
    def resident(self) -> int:
        """Held on the device between updates."""
        return self.base_weights + self.lora_params + self.optimizer

    @property
    def update_transient(self) -> int:
        """What an update adds on top of the resident state at its peak."""
        return self.gathered_units + self.lora_grads + self.activations + self.logits

    @property
    def peak(self) -> int:
        return self.resident + self.update_transient


@dataclass(frozen=True)
class EngineMemory:
    weights: int
    budget: int  # memoryFraction x GPU (GPU engines), weights + kvCacheGib (CPU)
    kv_cache: int
    kv_bytes_per_token: int

    @property
    def kv_tokens(self) -> int:
        return max(self.kv_cache, 0) // self.kv_bytes_per_token


@dataclass(frozen=True)
class MemoryPlan:
    gpu_memory: int
    settings: Settings
    trainer: TrainerMemory
    engine: EngineMemory
    problems: list[str]  # the job as written does not fit (a warning)
    impossible: list[str]  # cannot fit even with every offload (a refusal)

    def to_dict(self) -> dict[str, Any]:
        t, e = self.trainer, self.engine
        trainer = {k: _gib(v) for k, v in asdict(t).items()}
        trainer |= {"resident": _gib(t.resident), "peak": _gib(t.peak)}
        engine = {k: _gib(v) for k, v in asdict(e).items() if k != "kv_bytes_per_token"}
        engine |= {"kv_bytes_per_token": e.kv_bytes_per_token, "kv_tokens": e.kv_tokens}
        s = self.settings
        return {
            "gpuMemoryGiB": _gib(self.gpu_memory),
            "assumptions": {
                "trainerRanks": s.world,
                "microBatch": {"rows": s.rows, "tokens": s.rows * s.seq},
                "activationCheckpointing": s.checkpointing,
                "offloadParams": s.offload,
                "tensorParallel": s.tensor_parallel,
            },
            "trainerPerGpuGiB" if s.gpu else "trainerPerProcessGiB": trainer,
            "enginePerGpuGiB" if s.engine_gpu else "engineHostGiB": engine,
            "problems": self.problems + self.impossible,
        }


def _gib(n: int) -> float:
    return round(n / GIB, 3)


def _human(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def parse_size(text: str) -> int:
    """'80GiB', '80G', '141GB', '24576MiB', or bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a memory size: {text!r} (e.g. 80GiB)")
    number, unit, suffix = float(m[1]), m[2].upper(), (m[3] or "")
    base = 1000 if suffix.lower() == "b" and unit else 1024
    return int(number * base ** " KMGT".index(unit or " "))


# ---------------------------------------------------------------- the estimate


def activation_bytes_per_layer_token(shape: ModelShape, compute_bytes: int) -> int:
    q = shape.heads * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    elements = 2 * shape.hidden + 3 * q + 2 * kv + 4 * shape.intermediate
    return compute_bytes * (elements + shape.lora_ranks_per_layer) + 2 * 4 * shape.hidden


def activations(shape: ModelShape, s: Settings, checkpointing: bool) -> int:
    tokens = s.rows * s.seq
    layer = activation_bytes_per_layer_token(shape, s.compute_bytes) * tokens
    outside = tokens * shape.hidden * (4 + s.compute_bytes)  # final norm: fp32 input, output
    if checkpointing:
        held = shape.layers * tokens * shape.hidden * s.compute_bytes + layer
    else:
        held = shape.layers * layer
    return held + outside


def logits_bytes(shape: ModelShape, s: Settings) -> int:
    positions = s.rows * (s.response + 1)
    held = 2 * positions * shape.vocab * s.compute_bytes  # the logits and their gradient
    return held + CHUNK_TEMPORARIES * min(CHUNK_ROWS, positions) * shape.vocab * 4


def trainer_memory(shape: ModelShape, s: Settings) -> TrainerMemory:
    adapter = shape.lora_params + shape.critic_params
    lora = 4 * adapter // s.world
    base = shape.params * s.weight_bytes // s.world
    optimizer = 2 * lora
    gathered = 0
    if s.world > 1 or s.offload:  # FSDP2 gathers units only when it shards
        gathered = (shape.root_params + GATHERED_LAYERS * shape.layer_params) * s.compute_bytes
    full = activations(shape, s, checkpointing=False)
    ckpt = activations(shape, s, checkpointing=True)
    host = base + 2 * lora + optimizer if s.offload else 0
    return TrainerMemory(
        base_weights=0 if s.offload else base,
        gathered_units=gathered,
        lora_params=0 if s.offload else lora,
        lora_grads=0 if s.offload else lora,
        optimizer=0 if s.offload else optimizer,
        activations=ckpt if s.checkpointing else full,
        activations_checkpointed=ckpt,
        activations_full=full,
        logits=logits_bytes(shape, s),
        host_offloaded=host,
    )


def engine_memory(shape: ModelShape, s: Settings, gpu_memory: int) -> EngineMemory:
    tp = s.tensor_parallel
    weights = shape.params * s.weight_bytes // tp
    kv_heads = max(shape.kv_heads // tp, 1)  # fewer kv heads than ranks: replicated
    per_token = 2 * shape.layers * kv_heads * shape.head_dim * s.weight_bytes
    if s.engine_gpu:
        budget = int(s.memory_fraction * gpu_memory)
        return EngineMemory(weights, budget, budget - weights, per_token)
    return EngineMemory(weights, weights + s.kv_cache_bytes, s.kv_cache_bytes, per_token)


def estimate(shape: ModelShape, s: Settings, gpu_memory: int = DEFAULT_GPU_MEMORY) -> MemoryPlan:
    trainer = trainer_memory(shape, s)
    engine = engine_memory(shape, s, gpu_memory)
    problems, impossible = [], []
    gib = f"{_gib(gpu_memory):g} GiB"
    if s.gpu:
        if trainer.peak > gpu_memory:
            problems.append(
                f"trainer: an update peaks at ~{_gib(trainer.peak):.1f} GiB per GPU, over the "
                f"{gib} GPU ({_hint(s)})"
            )
        if s.colocated and trainer.resident + engine.budget > gpu_memory:
            problems.append(
                f"colocated: the trainer's resident ~{_gib(trainer.resident):.1f} GiB and the "
                f"engine's {s.memory_fraction:g} x {gib} exceed the GPU while the engine runs"
            )
        least = trainer_memory(shape, replace(s, offload=True, checkpointing=True, rows=1))
        if least.peak > gpu_memory:
            impossible.append(
                f"trainer: even with trainer.fsdp.offloadParams, activation checkpointing and one "
                f"sequence per micro-batch an update needs ~{_gib(least.peak):.1f} GiB per GPU, "
                f"over the {gib} GPU: more trainer GPUs or shorter sequences"
            )
    if s.engine_gpu:
        need = engine.weights + s.seq * engine.kv_bytes_per_token
        if engine.weights >= gpu_memory:
            impossible.append(
                f"engine: the weights alone take ~{_gib(engine.weights):.1f} GiB per GPU at "
                f"tensorParallelSize {s.tensor_parallel}, over the {gib} GPU"
            )
        elif need > engine.budget:
            problems.append(
                f"engine: weights ~{_gib(engine.weights):.1f} GiB per GPU leave no KV cache for "
                f"one {s.seq}-token sequence in memoryFraction {s.memory_fraction:g} of {gib}"
            )
    return MemoryPlan(gpu_memory, s, trainer, engine, problems, impossible)


def _hint(s: Settings) -> str:
    tips = []
    if not s.checkpointing:
        tips.append("trainer.activationCheckpointing")
    if not s.offload:
        tips.append("trainer.fsdp.offloadParams")
    tips.append("a smaller training.maxTokensPerMicroBatch or more trainer GPUs")
    return "try " + ", ".join(tips)


# ---------------------------------------------------------------- from a job


def settings_of(job: LoRARLJob) -> Settings:
    from lorarl.api.spec.placement import colocated
    from lorarl.plan.engines import engine_memory_fraction

    spec = job.spec
    t, r = spec.trainer, spec.rollout
    gpu = t.gpus_per_replica > 0
    world = t.replicas * (t.gpus_per_replica if gpu else (t.processes_per_replica or 1))
    weight = DTYPE_BYTES[spec.model.dtype]
    compute = 2 if gpu and t.fsdp.mixed_precision else weight
    seq = spec.data.max_prompt_tokens + spec.data.max_response_tokens
    rows = spec.training.micro_batch_size
    budget = spec.training.max_tokens_per_micro_batch
    if budget is not None:  # rows x longest <= budget; a longer sample runs alone
        rows = max(1, min(rows, budget // seq))
    ckpt = t.activation_checkpointing
    return Settings(
        world=world,
        gpu=gpu,
        weight_bytes=weight,
        compute_bytes=compute,
        rows=rows,
        seq=seq,
        response=spec.data.max_response_tokens,
        checkpointing=gpu if ckpt is None else ckpt,
        offload=t.fsdp.offload_params,
        tensor_parallel=r.tensor_parallel_size,
        engine_gpu=r.gpus_per_replica > 0,
        memory_fraction=engine_memory_fraction(spec),
        kv_cache_bytes=(r.kv_cache_gib or 1) * GIB,
        colocated=colocated(spec),
    )


def read_config(model: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(model, dict):
        return model
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    return json.loads(path.read_text())


def render(plan: MemoryPlan) -> str:
    """The plan as the text `lorarl plan --memory` prints."""
    t, e, s = plan.trainer, plan.engine, plan.settings
    who = "GPU" if s.gpu else "process (host memory)"
    lines = [
        f"memory plan (GPU size {_gib(plan.gpu_memory):g} GiB; estimate from config.json)",
        f"  trainer, per {who}: {s.world} rank(s), micro-batch {s.rows} x {s.seq} tokens, "
        f"checkpointing {'on' if s.checkpointing else 'off'}, "
        f"offload {'on' if s.offload else 'off'}",
    ]
    rows = [
        ("base weights (sharded)", t.base_weights),
        ("FSDP gathered units", t.gathered_units),
        ("LoRA params (fp32)", t.lora_params),
        ("LoRA grads (fp32)", t.lora_grads),
        ("AdamW state (2 x fp32)", t.optimizer),
        (f"activations ({'checkpointed' if s.checkpointing else 'full'})", t.activations),
        ("logits + grad", t.logits),
        ("peak", t.peak),
    ]
    lines += [f"    {name:<28}{_human(v):>12}" for name, v in rows]
    other = t.activations_full if s.checkpointing else t.activations_checkpointed
    lines.append(
        f"    (activations {'without' if s.checkpointing else 'with'} checkpointing: "
        f"{_human(other)})"
    )
    if s.offload:
        lines.append(f"    host, offloaded: {_human(t.host_offloaded)} per rank")
    where = "GPU" if s.engine_gpu else "engine (host memory)"
    lines += [
        f"  engine, per {where}: tensorParallelSize {s.tensor_parallel}",
        f"    {'weights':<28}{_human(e.weights):>12}",
        f"    {'KV cache':<28}{_human(max(e.kv_cache, 0)):>12}  (~{e.kv_tokens} tokens)",
    ]
    lines += [f"  warning: {p}" for p in plan.problems]
    lines += [f"  cannot fit: {p}" for p in plan.impossible]
    return "\n".join(lines) + "\n"
