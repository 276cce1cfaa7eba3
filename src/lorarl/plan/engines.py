"""Engine launch commands for a job spec. One function per engine so contract tests can pin each
to the engine's own argument parser; the engine-specific flags, env and values come from
lorarl.engines (this module maps spec fields onto them)."""

from __future__ import annotations

from lorarl.api.spec.environment import completion_tokens
from lorarl.api.spec.job import LoRARLJobSpec
from lorarl.api.spec.lora import values_here
from lorarl.api.spec.placement import (
    COLOCATED_MEMORY_FRACTION,
    colocated,
    releases_engine_memory,
)
from lorarl.api.spec.workloads import DEFAULT_MEMORY_FRACTION, ENGINE_API_KEY_ENV
from lorarl.engines import vllm
from lorarl.engines.flags import overriding_arg
from lorarl.engines.sglang import SGLANG_ORIGINAL_LOGPROB_ENV, sglang_server_args
from lorarl.engines.vllm import vllm_lora_rank, vllm_server_args, vllm_server_env

SERVED_MODEL_NAME = "base"
# The per-job engine key: a Secret in a cluster, generated per run locally. Engines get it as a
# `$(VAR)` reference that the kubelet (or LocalRun) expands, so its value is never in the plan.
ENGINE_API_KEY_REF = f"$({ENGINE_API_KEY_ENV})"
# Both engines must report logprobs of the distribution they sampled from (after temperature),
# which is what the trainer scores: vLLM via `--logprobs-mode` (lorarl.engines.vllm), SGLang via
# an environment variable pinned off (lorarl.engines.sglang).


def engine_command(spec: LoRARLJobSpec, model_path: str, host: str, port: int) -> list[str]:
    r = spec.rollout
    bad = overriding_arg(r.engine, r.engine_args, cpu=r.gpus_per_replica == 0)
    if bad is not None:  # the spec refuses it too; kept so no path reaches an engine with it
        raise ValueError(
            f"spec.rollout.engineArgs: {bad[:60]!r} overrides a flag lorarl sets for {r.engine}"
        )
    if spec.rollout.engine == "sglang":
        return sglang_command(spec, model_path, host, port)
    return vllm_command(spec, model_path, host, port)


def sglang_command(spec: LoRARLJobSpec, model_path: str, host: str, port: int) -> list[str]:
    r, lora = spec.rollout, values_here(spec.lora)  # read once: the adapter's config, if here
    args = sglang_server_args(
        model_path,
        host,
        port,
        served_model_name=SERVED_MODEL_NAME,
        dtype=spec.model.dtype,
        tensor_parallel_size=r.tensor_parallel_size,
        mem_fraction_static=engine_memory_fraction(spec),
        seed=spec.training.seed,
        api_key=ENGINE_API_KEY_REF,
        trust_remote_code=spec.model.trust_remote_code,
        lora_rank=lora.rank if r.sync_mode == "adapter" else None,
        lora_target_modules=lora.target_modules,
        memory_saver=releases_engine_memory(spec),
        extra_args=r.engine_args,
    )
    return ["python", *args]


def vllm_command(spec: LoRARLJobSpec, model_path: str, host: str, port: int) -> list[str]:
    r = spec.rollout
    args = vllm_server_args(
        model_path,
        host,
        port,
        served_model_name=SERVED_MODEL_NAME,
        dtype=spec.model.dtype,
        tensor_parallel_size=r.tensor_parallel_size,
        seed=spec.training.seed,
        max_model_len=spec.data.max_prompt_tokens + completion_tokens(spec),
        gpu_memory_utilization=engine_memory_fraction(spec) if r.gpus_per_replica > 0 else None,
        trust_remote_code=spec.model.trust_remote_code,
        max_lora_rank=vllm_lora_rank(values_here(spec.lora).rank)
        if r.sync_mode == "adapter"
        else None,
        sleep_mode=releases_engine_memory(spec),
        extra_args=r.engine_args,
    )
    return ["python", *args]


def engine_memory_fraction(spec: LoRARLJobSpec) -> float:
    """A colocated engine left at the default shares its GPUs with the trainer: it takes less."""
    fraction = spec.rollout.memory_fraction
    if colocated(spec) and fraction == DEFAULT_MEMORY_FRACTION:
        return COLOCATED_MEMORY_FRACTION
    return fraction


def engine_env(spec: LoRARLJobSpec) -> dict[str, str]:
    """Environment the engine needs: live weight updates (vLLM gates them behind flags) and,
    for vLLM, the API key (`VLLM_API_KEY` keeps it off the command line; SGLang has no such
    variable and gets `--api-key`, which a local run moves into the environment:
    `lorarl.local.env_refs.api_key_from_env`). SGLang: post-temperature logprobs, pinned."""
    if spec.rollout.engine != "vllm":
        return {SGLANG_ORIGINAL_LOGPROB_ENV: "false", **engine_cache_env(spec)}
    r = spec.rollout
    env = vllm_server_env(cpu=r.gpus_per_replica == 0, kv_cache_gib=r.kv_cache_gib or 1)
    return {**env, vllm.API_KEY_ENV: ENGINE_API_KEY_REF, **engine_cache_env(spec)}


def engine_cache_env(spec: LoRARLJobSpec) -> dict[str, str]:
    """With `rollout.cacheVolume`, the engine's compile caches live on that claim (a folder each)
    instead of the pod's /tmp, which dies with the pod."""
    cache = spec.rollout.cache_volume
    if cache is None:
        return {}
    root = cache.mount_path.rstrip("/")
    env = {"TORCHINDUCTOR_CACHE_DIR": f"{root}/torchinductor", "TRITON_CACHE_DIR": f"{root}/triton"}
    if spec.rollout.engine == "vllm":
        env["VLLM_CACHE_ROOT"] = f"{root}/vllm"
    return env
