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
The names themselves live with each engine (lorarl.engines.vllm, lorarl.engines.sglang).
"""

from __future__ import annotations

from collections.abc import Sequence

from lorarl.engines import sglang, vllm


def managed_flags(engine: str, *, cpu: bool) -> tuple[str, ...]:
    """The long flags (`--name`) the plan owns for this engine."""
    if engine == "sglang":
        return tuple(f"--{n}" for n in sglang.MANAGED_FLAGS)
    names = vllm.MANAGED_FLAGS + (vllm.MANAGED_CPU_FLAGS if cpu else ())
    return tuple(f"--{n}" for n in names)


def _flag_name(arg: str) -> str:
    """`--api_key=x` -> `api-key`; `--compilation-config.level` -> `compilation-config`."""
    return arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")


def overriding_arg(engine: str, args: Sequence[str], *, cpu: bool) -> str | None:
    """The first of `args` that sets, or abbreviates, a flag the plan owns; None if none does."""
    managed = [f[2:] for f in managed_flags(engine, cpu=cpu)]
    shorts = vllm.MANAGED_SHORT_FLAGS if engine == "vllm" else ()
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
