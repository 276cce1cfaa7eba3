"""Engine flags lorarl sets itself: `rollout.engineArgs` may add flags, never override these.

The plan (lorarl.plan.engines) decides the engines' API key, address, served model, logprob mode,
LoRA serving and the flags that mirror spec fields; a later `--api-key` or `--host` in
engineArgs would win (argparse keeps the last value) and open the engine to anyone, or silently
break the trainer's contract with it. Both engines' parsers accept unambiguous prefixes
(`--api-k`), and vLLM reads `_` as `-` and `--x.y` as part of `--x`, so a flag is matched after
the same normalization, and any prefix of a managed name is refused. `--config` is refused too:
the file it names can set every flag. A test keeps these lists equal to the flags the plan emits.
The sleep / memory-saver flags are managed because a colocated job's trainer depends on them
(`--no-enable-sleep-mode` would make every release fail); elsewhere nothing would use them.
"""

from __future__ import annotations

from collections.abc import Sequence

# Long option names (without `--`), every alias each engine's parser has for them.
_VLLM = (
    "model", "served-model-name", "host", "port", "uds", "dtype", "tensor-parallel-size",
    "logprobs-mode", "seed", "max-model-len", "trust-remote-code", "no-trust-remote-code",
    "enable-lora", "no-enable-lora", "max-lora-rank", "max-loras", "worker-extension-cls",
    "api-key", "config", "gpu-memory-utilization", "device-memory-utilization",
    "enable-sleep-mode", "no-enable-sleep-mode",
)  # fmt: skip
# Set only for a CPU engine (its batch budget, eager mode); free to tune on GPUs.
_VLLM_CPU = ("enforce-eager", "no-enforce-eager", "max-num-seqs", "max-num-batched-tokens")
_VLLM_SHORT = ("tp",)  # -tp is --tensor-parallel-size
_SGLANG = (
    "model-path", "model", "served-model-name", "host", "port", "dtype", "tp-size",
    "tensor-parallel-size", "mem-fraction-static", "random-seed", "api-key", "trust-remote-code",
    "enable-lora", "max-lora-rank", "max-loras-per-batch", "lora-target-modules", "config",
    "enable-memory-saver", "enable-weights-cpu-backup",
)  # fmt: skip


def managed_flags(engine: str, *, cpu: bool) -> tuple[str, ...]:
    """The long flags (`--name`) the plan owns for this engine."""
    names = _SGLANG if engine == "sglang" else _VLLM + (_VLLM_CPU if cpu else ())
    return tuple(f"--{n}" for n in names)


def _flag_name(arg: str) -> str:
    """`--api_key=x` -> `api-key`; `--compilation-config.level` -> `compilation-config`."""
    return arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")


def overriding_arg(engine: str, args: Sequence[str], *, cpu: bool) -> str | None:
    """The first of `args` that sets, or abbreviates, a flag the plan owns; None if none does."""
    managed = [f[2:] for f in managed_flags(engine, cpu=cpu)]
    shorts = _VLLM_SHORT if engine == "vllm" else ()
    for arg in args:
        if arg.startswith("--"):
            name = _flag_name(arg)
            if name and any(m.startswith(name) for m in managed):
                return arg
        elif arg.startswith("-") and len(arg) > 1:
            name = arg[1:].split("=", 1)[0]
            if any(s.startswith(name) or name.startswith(s) for s in shorts):
                return arg
    return None
