"""vLLM: the server flags lorarl sets, its environment, and the HTTP routes lorarl calls.

Pure values and functions of plain values (no I/O): the plan renders a job's command from these
(lorarl.plan.engines), the rollout sidecar and a local run start servers with them, and the
trainer and sidecar call the routes below. Contract tests pin each to the pinned vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Long option names (without `--`) lorarl sets, with every alias vLLM's parser has for them
# (lorarl.engines.flags refuses them in `rollout.engineArgs`).
MANAGED_FLAGS = (
    "model", "served-model-name", "host", "port", "uds", "dtype", "tensor-parallel-size",
    "logprobs-mode", "seed", "max-model-len", "trust-remote-code", "no-trust-remote-code",
    "enable-lora", "no-enable-lora", "max-lora-rank", "max-loras", "worker-extension-cls",
    "api-key", "config", "gpu-memory-utilization", "device-memory-utilization",
    "enable-sleep-mode", "no-enable-sleep-mode",
)  # fmt: skip
# Set only for a CPU engine (its batch budget, eager mode); free to tune on GPUs.
MANAGED_CPU_FLAGS = ("enforce-eager", "no-enforce-eager", "max-num-seqs", "max-num-batched-tokens")
MANAGED_SHORT_FLAGS = ("tp",)  # -tp is --tensor-parallel-size

# HTTP routes lorarl calls (the OpenAI server; the dev-mode ones need VLLM_SERVER_DEV_MODE=1).
HEALTH = "/health"
COMPLETIONS = "/v1/completions"
LOAD_LORA_ADAPTER = "/v1/load_lora_adapter"
UNLOAD_LORA_ADAPTER = "/v1/unload_lora_adapter"
RESET_PREFIX_CACHE = "/reset_prefix_cache"
COLLECTIVE_RPC = "/collective_rpc"  # dev mode
SLEEP = "/sleep"  # dev mode; `?level=1` keeps the weights on CPU
WAKE_UP = "/wake_up"  # dev mode
# The server reads its API key from this variable, which keeps it off the command line.
API_KEY_ENV = "VLLM_API_KEY"

# Importable wherever the engine runs (rollout image, `.venv-engine`); see rollout/vllm_worker_ext.
VLLM_WORKER_EXTENSION = "lorarl.rollout.vllm_worker_ext.LoraRLWorkerExtension"
# vLLM's own default for an OpenAI server on CPU (arg_utils); made explicit with the step budget.
VLLM_CPU_MAX_NUM_SEQS = 128
# vLLM's LoRAConfig.max_lora_rank is a Literal of these.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The trainer scores the distribution sampled from (after temperature); vLLM's default is the
# raw model distribution.
VLLM_LOGPROBS_MODE = "processed_logprobs"
# vLLM's front end talks to its engine core over ZMQ Unix sockets at <VLLM_RPC_BASE_PATH>/<uuid4>
# (default: TMPDIR), and a socket path must fit in 107 bytes: a run directory a few dozen
# characters deep would make the engine fail at start. See `vllm_rpc_base`.
VLLM_RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"
_UNIX_SOCKET_PATH_MAX = 107
_VLLM_IPC_SUFFIX_BYTES = 37  # "/" + a uuid4
# A colocated GPU engine gives its memory to each update (lorarl.trainer.fleet.engine_memory);
# vLLM's level-1 sleep keeps the weights on CPU.
VLLM_SLEEP_FLAGS = ("--enable-sleep-mode",)


def _user_cache(environ: Mapping[str, str], home: str, override: str, leaf: str) -> str:
    """$override if set, else <$XDG_CACHE_HOME or ~/.cache>/lorarl/<leaf>."""
    if environ.get(override):
        return environ[override]
    base = environ.get("XDG_CACHE_HOME") or f"{home}/.cache"
    return f"{base}/lorarl/{leaf}"


def vllm_cache_root(environ: Mapping[str, str], home: str) -> str:
    """Where every vLLM server one user starts outside a pod keeps vLLM's own caches: the user's
    $VLLM_CACHE_ROOT, else <$XDG_CACHE_HOME or ~/.cache>/lorarl/vllm.

    vLLM keys each entry by what it was made from (a model class's facts by the hash of its
    source file, compiled graphs by their config), so one root for all runs is vLLM's own default
    and safe. A fresh root per run made every start inspect the model class again in a
    subprocess that imports vLLM anew: 42.6 s to a healthy tiny-model server on 2 cores with an
    empty root, 24.7 s with a warm one (docs/measurements.md#engine-start).
    """
    return _user_cache(environ, home, "VLLM_CACHE_ROOT", "vllm")


def inductor_cache_dir(environ: Mapping[str, str], home: str) -> str:
    """Where torch Inductor keeps the kernels those servers compile: $TORCHINDUCTOR_CACHE_DIR, else
    <$XDG_CACHE_HOME or ~/.cache>/lorarl/torchinductor.

    A GPU engine compiles its graphs with torch.compile (a CPU engine runs with
    TORCHDYNAMO_DISABLE=1, docs/measurements.md#vllm-first-step); under Inductor's default
    (TMPDIR, which lorarl puts inside each run directory) every run would compile again. Entries
    are keyed by source and torch version, so sharing them is safe.
    """
    return _user_cache(environ, home, "TORCHINDUCTOR_CACHE_DIR", "torchinductor")


def vllm_rpc_base(tmp_dir: str) -> str:
    """Where a vLLM server whose TMPDIR is `tmp_dir` may put its sockets: `tmp_dir` when the
    paths fit, else /tmp (the names are uuids, so servers never collide there)."""
    fits = len(tmp_dir.encode()) + _VLLM_IPC_SUFFIX_BYTES <= _UNIX_SOCKET_PATH_MAX
    return tmp_dir if fits else "/tmp"


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
    served_model_name: str,
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
