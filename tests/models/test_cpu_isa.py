"""The instruction-set level read from a CPU's flags, and this machine's description."""

from __future__ import annotations

import pytest
import torch

import models.opt
from models import cpu_isa, cpu_kernels
from models.loader import build_preset
from models.opt import fit_matmuls_to

ZEN4 = ("flags : fpu sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl "
        "avx512_bf16 avx512_vnni")
# each level's lower ones: what a CPU capped at the level may show
LOWER = {"AVX-512-bf16": ("AVX-512", "AVX2", cpu_isa.BASELINE),
         "AVX-512": ("AVX2", cpu_isa.BASELINE), "AVX2": (cpu_isa.BASELINE,)}


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


@pytest.mark.parametrize("cap,level,march", [
    ("AVX2", "AVX2", "x86-64-v3"),
    ("AVX-512", "AVX-512", "x86-64-v4"),
    ("AVX-512-bf16", "AVX-512-bf16", "native"),
])
def test_max_isa_caps_the_level_and_the_kernels_build(cap: str, level: str, march: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    flags = cpu_isa.cap_flags(ZEN4 + " amx_bf16 amx_tile", cap)
    assert cpu_isa.level_of(flags) == level
    assert "avx2" in flags.split() and "fma" in flags.split()  # lower levels' flags stay
    monkeypatch.delenv("ASERVE_MARCH", raising=False)
    monkeypatch.setenv("ASERVE_MAX_ISA", cap)
    assert cpu_kernels.march() == march
    assert cpu_isa.level_of(cpu_isa.cpu_flags()) in (level, *LOWER[level])
    monkeypatch.setenv("ASERVE_MARCH", "haswell")  # an explicit -march still wins
    assert cpu_kernels.march() == "haswell"


def test_an_unknown_max_isa_is_named_in_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASERVE_MAX_ISA", "avx2")
    with pytest.raises(ValueError, match="ASERVE_MAX_ISA .'avx2'. must be one of AVX2"):
        cpu_isa.cpu_flags()


def test_bf16_matmuls_are_native_only_with_bf16_dot_products(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN takes bf16 matmuls on AVX-512 without bf16 instructions too, widening them
    (slower than the float32 path): a CPU capped there computes a bf16 model in float32."""
    monkeypatch.setenv("ASERVE_MAX_ISA", "AVX-512")
    cpu_isa.detect.cache_clear()
    try:
        assert not cpu_isa.detect().native_bf16_matmul
        assert not models.opt.has_half_matmul(torch.bfloat16)
        model = build_preset("opt-tiny", torch.bfloat16, "cpu", seed=0).model
        assert fit_matmuls_to(model, torch.device("cpu"))  # switched to float32
    finally:
        cpu_isa.detect.cache_clear()
