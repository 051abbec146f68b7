"""Builds and loads the CPU kernels written in C (`cpu_attention`, `cpu_gemm` and the
others): compiled with the system C compiler on first use, cached under $ASERVE_CACHE_DIR
(default ~/.cache/aserve) by a hash of the source, flags, compiler and CPU, loaded through
ctypes.

Each kernel is optional: `build` returns None without a compiler, when compiling fails, or
when ASERVE_CPU_KERNELS=0, and the caller keeps its torch path.

`advise_huge_pages` asks Linux for transparent huge pages under the large buffers those
kernels stream every decode step (the packed weights, the KV cache): with 4 KiB pages each
page read costs a TLB miss, a two-level page walk under a hypervisor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch

from models import cpu_isa

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-shared", "-fPIC", "-pthread")


def march() -> str:
    """The CPU the kernels are compiled for: this one (`native`), or the GCC `-march` name
    in ASERVE_MARCH, e.g. `haswell` for AVX2 code that also runs on older x86 CPUs sharing
    a cache; under ASERVE_MAX_ISA (`cpu_isa.CAPS`) the generic x86-64 level of that cap, to
    run and time a lower level's code paths on this machine (docs/results-cpu.md)."""
    cap = cpu_isa.max_isa()
    return (os.environ.get("ASERVE_MARCH") or (cap is not None and cpu_isa.CAPS[cap][1])
            or "native")

# C shared by the kernels written for whole registers (`cpu_norm`, `cpu_rotary`,
# `cpu_argmax`): GCC/Clang vector extensions of LANES floats, 16 where the CPU has AVX-512
# and 8 (an AVX2 register) elsewhere, so that every vector is one register; float32 and bf16
# loads and stores (rounded to the nearest even, as torch), one bf16 widened
VECTORS = r"""
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));

static inline vf load_f32(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
#ifdef __AVX512F__
#include <immintrin.h>
/* one widening load and one narrowing store (the generic forms below take four or five
   instructions each way) */
static inline vf load_bf16(const uint16_t *p) {  /* exact: bf16 is float's top half */
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline void narrow_bf16(uint16_t *p, vu u) {  /* the top halves of u's lanes */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32((__m512i)u, 16)));
}
#else
static inline vf load_bf16(const uint16_t *p) {  /* exact: bf16 is float's top half */
    vh h; memcpy(&h, p, sizeof h);
    vu w = __builtin_convertvector(h, vu) << 16;
    vf v; memcpy(&v, &w, sizeof v); return v;
}
static inline void narrow_bf16(uint16_t *p, vu u) {  /* the top halves of u's lanes */
    vh h = __builtin_convertvector(u >> 16, vh); memcpy(p, &h, sizeof h);
}
#endif
static inline float at_bf16(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16; float f; memcpy(&f, &u, sizeof f); return f;
}
static inline void store_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf same_f32(vf v) { return v; }
static inline vf round_bf16(vf v) {  /* to the nearest even bf16, NaN kept, as torch */
    vu u; memcpy(&u, &v, sizeof u);
    const vu nan = (vu)(v != v);
    u = ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u & ~nan) | (0x7fc00000u & nan);
    memcpy(&v, &u, sizeof v); return v;
}
static inline void store_bf16(uint16_t *p, vf v) {
    vu u; v = round_bf16(v); memcpy(&u, &v, sizeof u);
    narrow_bf16(p, u);
}
"""
VECTOR_KINDS = {torch.float32: 0, torch.bfloat16: 1}  # the dtype code VECTORS' kernels take
# Element-wise kernels run inputs up to this many elements (decode batches) in the calling
# thread: waking OpenMP's threads costs more than such a pass
ONE_THREAD = 1 << 17


def threads_for(numel: int) -> int:
    """The OpenMP threads an element-wise kernel takes for an input of `numel` elements:
    one up to ONE_THREAD, torch's count above."""
    return 1 if numel <= ONE_THREAD else torch.get_num_threads()


def _cache_dir() -> Path:
    return Path(os.environ.get("ASERVE_CACHE_DIR") or Path.home() / ".cache" / "aserve")


def build(name: str, source: str, argtypes: list[Any] | None = None,
          flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The shared library compiled from `source` (C) with `flags` besides FLAGS, named
    `name_<hash>.so` in the cache, its function `name` declared with `argtypes` and an int
    result; None when kernels are off, no compiler exists or compiling fails (logged)."""
    if os.environ.get("ASERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler: %s uses its torch path", name)
        return None
    # NOTE: -march=native code may not run on another CPU sharing this cache (a network home):
    # the key names this CPU's instruction sets.
    options = (*FLAGS, f"-march={march()}", *flags)
    key = "\n".join((source, " ".join(options), compiler, platform.machine(),
                     cpu_isa.cpu_flags()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = _cache_dir() / f"{name}_{digest}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src, built = Path(tmp) / f"{name}.c", Path(tmp) / path.name
                src.write_text(source)
                subprocess.run([compiler, *options, str(src), "-o", str(built), "-lm"],
                               check=True, capture_output=True, timeout=120)
                built.replace(path)  # atomic: concurrent processes see a whole library
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernel %s not built (%s): using its torch path", name, exc)
        return None
    function = getattr(lib, name)
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib


def build_openmp(name: str, source: str, argtypes: list[Any] | None = None
                 ) -> ctypes.CDLL | None:
    """`build` with OpenMP: -fopenmp links libgomp.so.1, which resolves to the copy torch
    has loaded (one pool of threads for torch and the kernels); a compiler without OpenMP
    builds the same kernel single-threaded."""
    return build(name, source, argtypes, ("-fopenmp",)) or build(name, source, argtypes)


MADV_HUGEPAGE = 14  # Linux madvise advice (asm-generic/mman-common.h)
_HUGE_PAGE_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")


@cache
def _madvise() -> tuple[Any, int] | None:
    """(libc's madvise, the huge page size in bytes), or None where transparent huge pages
    are unavailable (not Linux, THP compiled out or `never`) or ASERVE_HUGE_PAGES=0."""
    if platform.system() != "Linux" or os.environ.get("ASERVE_HUGE_PAGES", "1") == "0":
        return None
    try:
        size = int(_HUGE_PAGE_SIZE.read_text())
        mode = (_HUGE_PAGE_SIZE.parent / "enabled").read_text()
    except (OSError, ValueError):
        return None
    if "[never]" in mode:
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise, size


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Asks the kernel to back the huge-page-aligned part of CPU tensor `t`'s memory with
    transparent huge pages (`madvise(MADV_HUGEPAGE)`), so that reading it streams through
    few TLB entries. Only pages not yet touched are affected: call it on a fresh
    `torch.empty` before filling it. Returns whether advice was given (False off Linux,
    without THP, under ASERVE_HUGE_PAGES=0, off the CPU, for a tensor smaller than a huge
    page, or when madvise refuses); the tensor's contents never change."""
    found = _madvise()
    if found is None or t.device.type != "cpu":
        return False
    madvise, size = found
    start = t.data_ptr()
    end = start + t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    lo, hi = -(-start // size) * size, end // size * size
    if hi <= lo:
        return False
    if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
        logger.info("madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
        return False
    return True
