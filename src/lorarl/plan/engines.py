"""Engine launch commands. One function per engine so contract tests can pin each to the
engine's own argument parser."""

from __future__ import annotations

from lorarl.api.spec import LoRARLJobSpec

SERVED_MODEL_NAME = "base"
_SGLANG_LORA_TARGETS_ALL = "all"


def engine_command(spec: LoRARLJobSpec, model_path: str, host: str, port: int) -> list[str]:
    if spec.rollout.engine == "sglang":
        return sglang_command(spec, model_path, host, port)
    return vllm_command(spec, model_path, host, port)


def sglang_command(spec: LoRARLJobSpec, model_path: str, host: str, port: int) -> list[str]:
    r = spec.rollout
    argv = [
        "python", "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", host,
        "--port", str(port),
        "--dtype", spec.model.dtype,
        "--tp-size", str(r.tensor_parallel_size),
        "--mem-fraction-static", f"{r.memory_fraction:g}",
        "--random-seed", str(spec.training.seed),
    ]  # fmt: skip
    if spec.model.trust_remote_code:
        argv.append("--trust-remote-code")
    if r.sync_mode == "adapter":
        targets = spec.lora.target_modules
        argv += [
            "--enable-lora",
            "--max-lora-rank",
            str(spec.lora.rank),
            "--max-loras-per-batch",
            "2",
        ]
        argv += ["--lora-target-modules"]
        argv += [_SGLANG_LORA_TARGETS_ALL] if targets == ["all-linear"] else list(targets)
    return argv + list(r.engine_args)


def vllm_command(spec: LoRARLJobSpec, model_path: str, host: str, port: int) -> list[str]:
    r = spec.rollout
    argv = [
        "python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", host,
        "--port", str(port),
        "--dtype", spec.model.dtype,
        "--tensor-parallel-size", str(r.tensor_parallel_size),
        "--seed", str(spec.training.seed),
        "--max-model-len", str(spec.data.max_prompt_tokens + spec.data.max_response_tokens),
    ]  # fmt: skip
    if r.gpus_per_replica > 0:
        argv += ["--gpu-memory-utilization", f"{r.memory_fraction:g}"]
    else:
        argv += ["--enforce-eager"]  # DESIGN §11: CPU compile cache costs ~50 s per start
    if spec.model.trust_remote_code:
        argv.append("--trust-remote-code")
    if r.sync_mode == "adapter":
        argv += ["--enable-lora", "--max-lora-rank", str(spec.lora.rank), "--max-loras", "2"]
    return argv + list(r.engine_args)


def engine_env(spec: LoRARLJobSpec) -> dict[str, str]:
    """Environment the engine needs for live weight updates (vLLM gates them behind flags)."""
    if spec.rollout.engine != "vllm":
        return {}
    env = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_SERVER_DEV_MODE": "1",
    }
    if spec.rollout.gpus_per_replica == 0:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.rollout.kv_cache_gib or 1)
    return env
