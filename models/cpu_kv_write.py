"""Writing a step's new K/V rows into the paged cache on the CPU, in C, compiled once on
first use.

`models.attention.write_kv` addresses each new token's row in the flat view of the
block-major cache and copies the rows with two `index_copy_`s, after four element-wise
operators that turn slots into row numbers; on a prompt that is one row of a few hundred
bytes per token and layer, and torch's per-row indexing and the operators cost several
times the copy (docs/results-cpu.md, "KV writes and bf16 loads").
`write` makes one pass instead: per token, its block and offset from its slot, then its K
row and its V row copied whole. Slots are checked first; out of range, nothing is written
and `write` raises as `index_copy_` would. Tokens are shared out to the OpenMP threads
above `cpu_kernels.ONE_THREAD` elements (prompts); decode steps run in the calling thread.

Optional, as the torch path stays the reference: `write` returns False where the kernel
cannot run (another device, K/V not in the cache's dtype, a cache that is not contiguous,
tensors autograd tracks, no C compiler); K/V whose heads are not contiguous are copied
first. Built and cached by `models.cpu_kernels` (ASERVE_CPU_KERNELS=0 disables it).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import Tensor

from models import cpu_kernels
from models.cpu_attention import heads_contiguous

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* Token t's K row (row bytes, k + t * k_stride bytes) goes to its slot's row of `layer`
   in the block-major cache [blocks, layers, 2, block_size, row], its V row block_size rows
   further. Returns 1 (nothing written) if a slot is outside [0, num_slots). */
int write_kv(char *cache, const char *k, int64_t k_stride, const char *v, int64_t v_stride,
             const int64_t *slots, int64_t n, int64_t row, int64_t layer, int64_t layers,
             int64_t block_size, int64_t num_slots, int threads) {
    for (int64_t t = 0; t < n; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1;
    const int64_t block_rows = layers * 2 * block_size, first = layer * 2 * block_size;
    #pragma omp parallel for num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < n; t++) {
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        char *dst = cache + (block * block_rows + first + offset) * row;
        memcpy(dst, k + t * k_stride, row);
        memcpy(dst + block_size * row, v + t * v_stride, row);
    }
    return 0;
}
"""


@cache
def _library() -> ctypes.CDLL | None:
    """Compiles (once per source and flags) and loads the kernel; None when it cannot."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    argtypes = [ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_int]
    return cpu_kernels.build_openmp("write_kv", _SOURCE, argtypes)


def write(kv_cache: Tensor, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor) -> bool:
    """`models.attention.write_kv` (same arguments) on the CPU; False where the kernel
    cannot run (module docstring). Raises IndexError, writing nothing, if a slot lies
    outside the cache."""
    num_blocks, layers, _, block_size, heads, dim = kv_cache.shape
    if (kv_cache.device.type != "cpu" or not kv_cache.is_contiguous()
            or k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype
            or k.device.type != "cpu" or v.device.type != "cpu"
            or k.shape != v.shape or k.shape[1:] != (heads, dim)
            or slot_mapping.device.type != "cpu" or slot_mapping.dtype != torch.long
            or slot_mapping.shape != k.shape[:1] or not 0 <= layer < layers
            or any(t.requires_grad for t in (kv_cache, k, v))):
        return False
    if (lib := _library()) is None:
        return False
    k, v = heads_contiguous(k), heads_contiguous(v)  # rows may be strided
    slots = slot_mapping.contiguous()
    size = kv_cache.element_size()
    status = lib.write_kv(kv_cache.data_ptr(), k.data_ptr(), k.stride(0) * size, v.data_ptr(),
                          v.stride(0) * size, slots.data_ptr(), slots.shape[0],
                          heads * dim * size, layer, layers, block_size,
                          num_blocks * block_size, cpu_kernels.threads_for(k.numel()))
    if status:
        total = num_blocks * block_size
        bad = slots[(slots < 0) | (slots >= total)][0].item()
        raise IndexError(f"write_kv: slot {bad} lies outside the cache's {total} slots")
    return True
