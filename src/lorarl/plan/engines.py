"""Engine launch commands. One function per engine so contract tests can pin each to the
engine's own argument parser."""

from __future__ import annotations

from collections.abc import Sequence

from lorarl.api.spec.engine_flags import overriding_arg
from lorarl.api.spec.environment import completion_tokens
from lorarl.api.spec.job import LoRARLJobSpec
from lorarl.api.spec.placement import (
    COLOCATED_MEMORY_FRACTION,
    colocated,
    releases_engine_memory,
)
from lorarl.api.spec.workloads import DEFAULT_MEMORY_FRACTION, ENGINE_API_KEY_ENV

SERVED_MODEL_NAME = "base"
# Importable wherever the engine runs (rollout image, `.venv-engine`); see rollout/vllm_worker_ext.
VLLM_WORKER_EXTENSION = "lorarl.rollout.vllm_worker_ext.LoraRLWorkerExtension"
# vLLM's LoRAConfig.max_lora_rank is a Literal of these.
# vLLM's own default for an OpenAI server on CPU (arg_utils); made explicit with the step budget.
VLLM_CPU_MAX_NUM_SEQS = 128
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_SGLANG_LORA_TARGETS_ALL = "all"
# The per-job engine key: a Secret in a cluster, generated per run locally. Engines get it as a
# `$(VAR)` reference that the kubelet (or LocalRun) expands, so its value is never in the plan.
ENGINE_API_KEY_REF = f"$({ENGINE_API_KEY_ENV})"
# Both engines must report logprobs of the distribution they sampled from (after temperature),
# which is what the trainer scores: vLLM's default is the raw model distribution, SGLang's is
# post-temperature unless this variable is set (pinned off, whatever the image says).
VLLM_LOGPROBS_MODE = "processed_logprobs"
# vLLM's front end talks to its engine core over ZMQ Unix sockets at <VLLM_RPC_BASE_PATH>/<uuid4>
# (default: TMPDIR), and a socket path must fit in 107 bytes: a run directory a few dozen
# characters deep would make the engine fail at start. See `vllm_rpc_base`.
VLLM_RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"
_UNIX_SOCKET_PATH_MAX = 107
_VLLM_IPC_SUFFIX_BYTES = 37  # "/" + a uuid4


def vllm_rpc_base(tmp_dir: str) -> str:
    """Where a vLLM server whose TMPDIR is `tmp_dir` may put its sockets: `tmp_dir` when the
    paths fit, else /tmp (the names are uuids, so servers never collide there)."""
    fits = len(tmp_dir.encode()) + _VLLM_IPC_SUFFIX_BYTES <= _UNIX_SOCKET_PATH_MAX
    return tmp_dir if fits else "/tmp"


SGLANG_ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
# A colocated GPU engine gives its memory to each update (lorarl.trainer.fleet.engine_memory).
# SGLang
# drops released weights unless backed up on CPU, and they must come back as they were: a merged
# sync rewrites only the LoRA target layers, an adapter sync none of the base (vLLM's level-1
# sleep always keeps them on CPU).
VLLM_SLEEP_FLAGS = ("--enable-sleep-mode",)
SGLANG_MEMORY_SAVER_FLAGS = ("--enable-memory-saver", "--enable-weights-cpu-backup")


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
    r = spec.rollout
    argv = [
        "python", "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", host,
        "--port", str(port),
        "--dtype", spec.model.dtype,
        "--tp-size", str(r.tensor_parallel_size),
        "--mem-fraction-static", f"{engine_memory_fraction(spec):g}",
        "--random-seed", str(spec.training.seed),
        "--api-key", ENGINE_API_KEY_REF,
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
    if releases_engine_memory(spec):
        argv += SGLANG_MEMORY_SAVER_FLAGS
    return argv + list(r.engine_args)


def vllm_command(spec: LoRARLJobSpec, model_path: str, host: str, port: int) -> list[str]:
    r = spec.rollout
    args = vllm_server_args(
        model_path,
        host,
        port,
        dtype=spec.model.dtype,
        tensor_parallel_size=r.tensor_parallel_size,
        seed=spec.training.seed,
        max_model_len=spec.data.max_prompt_tokens + completion_tokens(spec),
        gpu_memory_utilization=engine_memory_fraction(spec) if r.gpus_per_replica > 0 else None,
        trust_remote_code=spec.model.trust_remote_code,
        max_lora_rank=vllm_lora_rank(spec.lora.rank) if r.sync_mode == "adapter" else None,
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


def vllm_lora_rank(rank: int) -> int:
    """vLLM only accepts `--max-lora-rank` from a fixed set; serve a rank-r adapter with the
    smallest allowed bound >= r (an adapter of lower rank loads fine under a larger bound)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"spec.lora.rank: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}, got {rank}; "
        "use syncMode 'merged' or a smaller rank"
    )


def vllm_server_args(
    model_path: str,
    host: str,
    port: int,
    *,
    served_model_name: str = SERVED_MODEL_NAME,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    seed: int | None = None,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    trust_remote_code: bool = False,
    max_lora_rank: int | None = None,
    max_loras: int = 2,
    worker_extension_cls: str | None = VLLM_WORKER_EXTENSION,
    sleep_mode: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Everything after the interpreter: the one place the vLLM server's flags are decided.

    `-m ...api_server` because `vllm serve` fails for the vllm-cpu distribution name. No GPU
    memory fraction means a CPU engine: eager mode, since a CPU compile cache recompiles for
    ~50 s on every start (docs/architecture.md#measured-facts). `max_lora_rank` set turns LoRA
    serving on; two slots so the next version loads before the previous one is unloaded. The
    worker extension only adds methods (reading back the weights in use), so it is on everywhere.
    `--logprobs-mode processed_logprobs`: logprobs after temperature (and top-k/top-p), i.e. of
    the distribution sampled from, not vLLM's default raw model distribution. `sleep_mode`: the
    engine shares its GPUs with the trainer and sleeps through each update (colocated).
    """
    argv = [
        "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path),
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--logprobs-mode", VLLM_LOGPROBS_MODE,
    ]  # fmt: skip
    if seed is not None:
        argv += ["--seed", str(seed)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    else:
        argv += ["--enforce-eager"]
        if max_model_len is not None:
            argv += cpu_batch_budget(max_model_len)
    if trust_remote_code:
        argv.append("--trust-remote-code")
    if max_lora_rank is not None:
        argv += ["--enable-lora", "--max-lora-rank", str(max_lora_rank)]
        argv += ["--max-loras", str(max_loras)]
    if worker_extension_cls:
        argv += ["--worker-extension-cls", worker_extension_cls]
    if sleep_mode:
        argv += VLLM_SLEEP_FLAGS
    return argv + list(extra_args)


def cpu_batch_budget(max_model_len: int, max_num_seqs: int = VLLM_CPU_MAX_NUM_SEQS) -> list[str]:
    """A CPU engine's step budget, large enough that no prompt's prefill is ever split.

    vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a seeded request's
    prefill is chunked across steps: it rewinds the request's generator, which CPU generators
    cannot do. With the CPU server's default budget (2048 tokens, 128 sequences) that happens as
    soon as the waiting prompts exceed 2048 tokens: 128 seeded requests of ~25 tokens on one
    engine killed it (seen in the cluster e2e's one-replica job; tests/e2e/
    test_vllm_sync_exact.py). A budget of max_num_seqs full-length sequences never splits one.
    """
    return ["--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_seqs * max_model_len)]  # fmt: skip


def engine_env(spec: LoRARLJobSpec) -> dict[str, str]:
    """Environment the engine needs: live weight updates (vLLM gates them behind flags) and,
    for vLLM, the API key (`VLLM_API_KEY` keeps it off the command line; SGLang has no such
    variable and gets `--api-key`, which a local run moves into the environment:
    `lorarl.local.env_refs.api_key_from_env`). SGLang: post-temperature logprobs, pinned."""
    if spec.rollout.engine != "vllm":
        return {SGLANG_ORIGINAL_LOGPROB_ENV: "false"}
    r = spec.rollout
    env = vllm_server_env(cpu=r.gpus_per_replica == 0, kv_cache_gib=r.kv_cache_gib or 1)
    return {**env, "VLLM_API_KEY": ENGINE_API_KEY_REF}


def vllm_server_env(*, cpu: bool, kv_cache_gib: int = 1) -> dict[str, str]:
    """Runtime LoRA loading and `/collective_rpc` (dev mode) are how the sidecar updates weights.

    On CPU, V1 multiprocessing off starts in ~4.5 s instead of ~20 s and is deterministic.
    Dynamo off on CPU: the engine runs eager anyway (`--enforce-eager`), but vLLM still wraps
    one logprobs helper (token ranks) in `torch.compile`, and its Inductor build on the first
    request with logprobs made every fresh engine's first step take ~21 s instead of ~0.8 s
    (docs/architecture.md#measured-facts). Every rollout request asks for logprobs.
    """
    env = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if cpu:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env
