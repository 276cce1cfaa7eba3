"""A local bfloat16 run on a CPU without native bf16 is told to use float32."""

from __future__ import annotations

from lorarl.local.cpu_dtype import cpu_flags, emulated_bf16_warning

EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16\n"
OLD_XEON = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16\n"


def test_flags_come_from_the_first_processor():
    assert {"avx2", "avx512_bf16"} <= cpu_flags(EPYC)
    assert "bf16" in cpu_flags(ARM)
    assert cpu_flags("nothing here") == set()


def test_an_x86_cpu_without_native_bf16_gets_a_warning_naming_the_field():
    warning = emulated_bf16_warning("bfloat16", OLD_XEON)
    assert warning is not None and "spec.model.dtype" in warning and "float32" in warning


def test_no_warning_where_bf16_is_native_the_dtype_is_float32_or_the_cpu_is_unknown():
    assert emulated_bf16_warning("bfloat16", EPYC) is None
    assert emulated_bf16_warning("bfloat16", EPYC.replace("avx512_bf16", "amx_bf16")) is None
    assert emulated_bf16_warning("float32", OLD_XEON) is None
    assert emulated_bf16_warning("bfloat16", ARM) is None
    assert emulated_bf16_warning("bfloat16", None) is None
