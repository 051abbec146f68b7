"""Row-wise argmax of bf16 logits on the CPU, in C, compiled once on first use.

Greedy decoding takes one argmax per row of `[num_seqs, vocab_size]` logits. torch's CPU
argmax is a scalar loop, its vectorised max of bf16 is slow too, and widening bf16 logits to
float32 first costs a pass that writes twice the bytes it reads (float32 logits take
`models.sampler.argmax`'s block-wise torch path, as fast as this kernel there). This kernel
reads each bf16 row once, as it lies: per vector lane the
largest value so far and where it was (strictly larger replaces, so each lane keeps its
first), and whether a NaN went by; then the lanes' answers combine into torch's own: the
first NaN where a row has one, else the first position of the row's maximum. Rows are shared
out to torch's OpenMP threads. Vectors are one register each (`cpu_kernels.VECTORS`: 16
floats with AVX-512, 8 with AVX2). Built and cached by `models.cpu_kernels`
(ASERVE_CPU_KERNELS=0 disables it); `argmax` returns None where it cannot run and the
caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import Tensor

from models import cpu_kernels

_SOURCE = cpu_kernels.VECTORS + r"""
/* The first position of row x's maximum (n values), or of its first NaN. Four sets of
   lanes run side by side (independent chains); a NaN seen anywhere sends the row to a
   scalar search for the first one. */
#define ROW(NAME, T, LOAD, AT)                                                            \
static int64_t NAME(const T *x, int64_t n) {                                              \
    const int64_t whole = n / (4 * LANES) * (4 * LANES);                                  \
    vi lane;                                                                              \
    for (int j = 0; j < LANES; j++) lane[j] = j;                                          \
    vf best[4];                                                                           \
    vi where[4], odd = {0};                                                               \
    for (int k = 0; k < 4; k++)  /* position 0 in every lane: ties keep it */             \
        best[k] = (vf){0} + AT(x, 0), where[k] = (vi){0};                                 \
    for (int64_t i = 0; i < whole; i += 4 * LANES)                                        \
        for (int k = 0; k < 4; k++) {                                                     \
            const vf v = LOAD(x + i + LANES * k);                                         \
            const vi more = v > best[k];                                                  \
            best[k] = (vf)((more & (vi)v) | (~more & (vi)best[k]));                       \
            where[k] = (more & (lane + (int32_t)(i + LANES * k))) | (~more & where[k]);   \
            odd |= v != v;                                                                \
        }                                                                                 \
    float top = best[0][0]; int64_t at = where[0][0], nan = 0;                            \
    for (int k = 0; k < 4; k++)                                                           \
        for (int j = 0; j < LANES; j++) {                                                 \
            nan |= odd[j];                                                                \
            if (best[k][j] > top || (best[k][j] == top && where[k][j] < at))              \
                top = best[k][j], at = where[k][j];                                       \
        }                                                                                 \
    for (int64_t i = whole; i < n; i++) {                                                 \
        const float v = AT(x, i);                                                         \
        nan |= v != v;                                                                    \
        if (v > top) top = v, at = i;                                                     \
    }                                                                                     \
    if (nan)                                                                              \
        for (int64_t i = 0; i < n; i++)                                                   \
            if (AT(x, i) != AT(x, i)) return i;                                           \
    return at;                                                                            \
}

ROW(row_bf16, uint16_t, load_bf16, at_bf16)

/* out[r] = argmax of row r (rows `stride` elements apart); 0 */
int argmax_rows(const uint16_t *x, int64_t rows, int64_t n, int64_t stride, int64_t *out,
                int num_threads) {
    #pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1)
    for (int64_t r = 0; r < rows; r++) out[r] = row_bf16(x + r * stride, n);
    return 0;
}
"""

MAX_VOCAB = 1 << 31  # positions are int32 lanes


@cache
def _library() -> ctypes.CDLL | None:
    """Compiles (once per source and flags) and loads the kernel; None when it cannot."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
    return cpu_kernels.build_openmp("argmax_rows", _SOURCE, argtypes)


def argmax(logits: Tensor) -> Tensor | None:
    """`logits.argmax(dim=-1)` (`[num_seqs]` long) of `[num_seqs, vocab_size]` bf16 CPU
    logits with contiguous rows, ties and NaN alike; None for anything else."""
    if (logits.dtype != torch.bfloat16 or logits.device.type != "cpu" or logits.dim() != 2
            or logits.stride(1) != 1 or not 0 < logits.shape[1] < MAX_VOCAB
            or (lib := _library()) is None):
        return None
    out = torch.empty(logits.shape[0], dtype=torch.long)
    lib.argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                    out.data_ptr(), torch.get_num_threads())
    return out
