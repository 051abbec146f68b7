"""The instruction-set level read from a CPU's flags, and this machine's description."""

from __future__ import annotations

import pytest

from models import cpu_isa

ZEN4 = ("flags : fpu sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl "
        "avx512_bf16 avx512_vnni")


@pytest.mark.parametrize("flags,level", [
    (ZEN4 + " amx_bf16 amx_tile", "AMX"),
    (ZEN4, "AVX-512-bf16"),
    (ZEN4.replace(" avx512_bf16", ""), "AVX-512"),
    ("flags : fpu sse2 avx avx2 fma", "AVX2"),
    ("flags : fpu sse2 avx avx2", cpu_isa.BASELINE),  # no FMA: not the AVX2 level
    ("Features : fp asimd", cpu_isa.BASELINE),
    ("", cpu_isa.BASELINE),
])
def test_level_is_the_best_whose_flags_are_all_present(flags: str, level: str) -> None:
    assert cpu_isa.level_of(flags) == level


def test_description_names_the_level_and_the_matmul_path() -> None:
    isa = cpu_isa.detect()
    text = cpu_isa.describe()
    assert text.startswith(isa.level) and isa.torch_capability in text
    assert ("bf16 matmuls native" in text) == isa.native_bf16_matmul
    assert set(isa.flags) <= set(cpu_isa.cpu_flags().split())
