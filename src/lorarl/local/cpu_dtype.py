"""Warn when a local CPU run asks for bfloat16 on a CPU that would only emulate it.

bfloat16 (`model.dtype`'s default) is the fast choice on CPUs with AVX512-BF16 or AMX: a bf16
matmul ran ~2.4x fp32's on such a CPU (docs/architecture.md, Measured facts). Elsewhere torch
emulates it and float32 is faster, so a local run says so instead of quietly running slow.
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo_text: str) -> set[str]:
    """The first processor's feature flags (x86 `flags`, Arm `Features`)."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def emulated_bf16_warning(dtype: str, cpuinfo_text: str | None) -> str | None:
    """One line for a bfloat16 job on an x86 CPU without native bf16; None otherwise (and when
    the flags cannot be read: no guess)."""
    if dtype != "bfloat16" or not cpuinfo_text:
        return None
    flags = cpu_flags(cpuinfo_text)
    if not flags or "avx2" not in flags or flags & NATIVE_BF16_FLAGS:
        return None  # unknown, not x86, or native bf16
    return (
        "spec.model.dtype is bfloat16 but this CPU has no AVX512-BF16 or AMX, so torch emulates "
        "it: set spec.model.dtype: float32 for a faster local run"
    )


def read_cpuinfo(path: Path = CPUINFO) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
