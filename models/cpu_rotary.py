"""The rotary embedding of a step's queries and keys on the CPU, in C, compiled once on first
use.

torch computes it as three element-wise operators per layer (`x * cos`, the halves swapped
by `roll`, then `addcmul`), each a pass over every query and key row and one dispatch; a
prompt step of 2,048 tokens spends more time in them than in its attention's softmax.
`rotate` makes one pass: per row and head, the first half of the result is
`x1 * cos + x2 * sin` and the second `x2 * cos + x1 * sin` (the sin's first half negated by
`models.llama.rotary_tables`), each product `x * cos` rounded to the dtype before the sum,
as the operators round it. Inputs of up to `cpu_kernels.ONE_THREAD` elements (decode
steps) run in the calling thread, larger ones a share of the rows per OpenMP thread. Built
and cached by `models.cpu_kernels` (ASERVE_CPU_KERNELS=0 disables it); other dtypes,
devices and head dims (a multiple of 32 runs here: two halves of whole registers) take
torch's path.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import Tensor

from models import cpu_kernels

_SOURCE = cpu_kernels.VECTORS + r"""
/* y[t, h] = rotated x[t, h] for rows t < n and heads h < heads of dim (a multiple of
   2 * LANES); x rows x_row elements apart, y contiguous, cos and sin [n, dim]. */
#define ROTATE(NAME, T, LOAD, ROUND, STORE)                                              \
static void NAME(const T *x, int64_t x_row, const T *cos, const T *sin, T *y, int64_t n, \
                 int64_t heads, int64_t dim, int threads) {                              \
    const int64_t half = dim / 2;                                                        \
    _Pragma("omp parallel for num_threads(threads) if (threads > 1)")                    \
    for (int64_t t = 0; t < n; t++)                                                      \
        for (int64_t h = 0; h < heads; h++) {                                            \
            const T *xh = x + t * x_row + h * dim, *c = cos + t * dim, *s = sin + t * dim; \
            T *yh = y + (t * heads + h) * dim;                                           \
            for (int64_t i = 0; i < half; i += LANES) {                                  \
                const vf a = LOAD(xh + i), b = LOAD(xh + half + i);                      \
                STORE(yh + i, ROUND(a * LOAD(c + i)) + b * LOAD(s + i));                 \
                STORE(yh + half + i, ROUND(b * LOAD(c + half + i)) + a * LOAD(s + half + i)); \
            }                                                                            \
        }                                                                                \
}

ROTATE(rotate_f32, float, load_f32, same_f32, store_f32)
ROTATE(rotate_bf16, uint16_t, load_bf16, round_bf16, store_bf16)

int rotate(const void *x, int64_t x_row, const void *cos, const void *sin, void *y, int64_t n,
           int64_t heads, int64_t dim, int bf16, int threads) {
    if (bf16) rotate_bf16(x, x_row, cos, sin, y, n, heads, dim, threads);
    else rotate_f32(x, x_row, cos, sin, y, n, heads, dim, threads);
    return 0;
}
"""

@cache
def _library() -> ctypes.CDLL | None:
    """Compiles (once per source and flags) and loads the kernel; None when it cannot."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    return cpu_kernels.build_openmp("rotate", _SOURCE, argtypes)


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor | None:
    """`models.llama.rotate` of `[n, heads, head_dim]` x (rows may be strided, as a view of
    a fused projection) with `[n, head_dim]` tables, as a new contiguous tensor; None where
    the kernel cannot run (the caller keeps torch's path)."""
    kind = cpu_kernels.VECTOR_KINDS.get(x.dtype)
    n, heads, dim = x.shape
    if (kind is None or x.device.type != "cpu" or dim % 32 or x.stride(2) != 1
            or x.stride(1) != dim or cos.dtype != x.dtype or signed_sin.dtype != x.dtype
            or torch.is_grad_enabled() or (lib := _library()) is None):
        return None
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    y = torch.empty((n, heads, dim), dtype=x.dtype)
    lib.rotate(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), y.data_ptr(),
               n, heads, dim, kind, cpu_kernels.threads_for(x.numel()))
    return y
