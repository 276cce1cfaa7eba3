"""SGLang: the server flags lorarl sets, its environment, and the HTTP routes lorarl calls.

Pure values and functions of plain values (no I/O): the plan renders a job's command from these
(lorarl.plan.engines), the rollout sidecar and the trainer call the routes below. Contract tests
pin each to the pinned SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence

# Long option names (without `--`) lorarl sets, with every alias SGLang's parser has for them
# (lorarl.engines.flags refuses them in `rollout.engineArgs`).
MANAGED_FLAGS = (
    "model-path", "model", "served-model-name", "host", "port", "dtype", "tp-size",
    "tensor-parallel-size", "mem-fraction-static", "random-seed", "api-key", "trust-remote-code",
    "enable-lora", "max-lora-rank", "max-loras-per-batch", "lora-target-modules", "config",
    "enable-memory-saver", "enable-weights-cpu-backup",
)  # fmt: skip

# HTTP routes lorarl calls.
HEALTH = "/health"
GENERATE = "/generate"
SERVER_INFO = "/server_info"
LOAD_LORA_ADAPTER = "/load_lora_adapter"
UNLOAD_LORA_ADAPTER = "/unload_lora_adapter"
FLUSH_CACHE = "/flush_cache"
INIT_WEIGHTS_UPDATE_GROUP = "/init_weights_update_group"
DESTROY_WEIGHTS_UPDATE_GROUP = "/destroy_weights_update_group"
BEGIN_WEIGHT_UPDATE = "/begin_weight_update"
END_WEIGHT_UPDATE = "/end_weight_update"
UPDATE_WEIGHTS_FROM_DISTRIBUTED = "/update_weights_from_distributed"
RELEASE_MEMORY_OCCUPATION = "/release_memory_occupation"
RESUME_MEMORY_OCCUPATION = "/resume_memory_occupation"
# LoRAManager's error text when a load names an adapter already loaded.
LORA_ALREADY_LOADED = "already loaded"

# `--lora-target-modules` value for every linear layer (lorarl's `all-linear`).
SGLANG_LORA_TARGETS_ALL = "all"
# SGLang returns post-temperature logprobs (what the trainer scores) unless this variable is
# set; lorarl pins it off, whatever the image says.
SGLANG_ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
# A colocated GPU engine gives its memory to each update (lorarl.trainer.fleet.engine_memory).
# SGLang drops released weights unless backed up on CPU, and they must come back as they were:
# a merged sync rewrites only the LoRA target layers, an adapter sync none of the base.
SGLANG_MEMORY_SAVER_FLAGS = ("--enable-memory-saver", "--enable-weights-cpu-backup")
SGLANG_MAX_LORAS_PER_BATCH = 2  # the next version loads before the previous one is unloaded


def sglang_server_args(
    model_path: str,
    host: str,
    port: int,
    *,
    served_model_name: str,
    dtype: str,
    tensor_parallel_size: int,
    mem_fraction_static: float,
    seed: int,
    api_key: str,
    trust_remote_code: bool = False,
    lora_rank: int | None = None,
    lora_target_modules: Sequence[str] = (),
    memory_saver: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Everything after the interpreter: the one place the SGLang server's flags are decided.

    `lora_rank` set turns LoRA serving on for `lora_target_modules` (`all-linear` -> `all`);
    `memory_saver`: the engine shares its GPUs with the trainer and releases its memory through
    each update (colocated).
    """
    argv = [
        "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--tp-size", str(tensor_parallel_size),
        "--mem-fraction-static", f"{mem_fraction_static:g}",
        "--random-seed", str(seed),
        "--api-key", api_key,
    ]  # fmt: skip
    if trust_remote_code:
        argv.append("--trust-remote-code")
    if lora_rank is not None:
        argv += [
            "--enable-lora",
            "--max-lora-rank",
            str(lora_rank),
            "--max-loras-per-batch",
            str(SGLANG_MAX_LORAS_PER_BATCH),
        ]
        argv += ["--lora-target-modules"]
        targets = list(lora_target_modules)
        argv += [SGLANG_LORA_TARGETS_ALL] if targets == ["all-linear"] else targets
    if memory_saver:
        argv += SGLANG_MEMORY_SAVER_FLAGS
    return argv + list(extra_args)
