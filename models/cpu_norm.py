"""LayerNorm and RMSNorm of a few rows on the CPU in one thread, in C, compiled once on
first use.

torch's CPU LayerNorm shares its rows out to the OpenMP threads on every call. At a decode
batch (tens of rows) the norm itself takes a few microseconds, and waking the pool's
sleeping threads (OMP_WAIT_POLICY=PASSIVE, or a thread parked by the OS) costs several
times that; OPT runs two norms per layer. `LayerNorm` computes such small inputs in the
calling thread instead: mean, then the variance about it, in float32 (bf16 values widened
exactly), the result rounded once to the input's dtype, as torch does. `RMSNorm` does the
same for Llama's norm, which torch runs as seven element-wise operators (each a pass over
the rows and a dispatch; 30 layers of SmolLM2 run 60 norms a step). Larger inputs, other
dtypes and devices take torch's own path. Built and cached by `models.cpu_kernels`
(ASERVE_CPU_KERNELS=0 disables it).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import cpu_kernels

MAX_ELEMENTS = cpu_kernels.ONE_THREAD  # inputs up to this size run in one thread

_SOURCE = cpu_kernels.VECTORS + r"""
#include <math.h>

static inline float total(vf v) {  /* lanes added pairwise */
    float t[LANES]; memcpy(t, &v, sizeof t);
    for (int s = LANES / 2; s > 0; s /= 2)
        for (int j = 0; j < s; j++) t[j] += t[j + s];
    return t[0];
}

/* y = (x - mean) / sqrt(var + eps) * w + b per row of n (a multiple of LANES); w, b NULL:
   no affine. Mean first, then the variance about it, in float32. */
#define NORM(NAME, T, LOAD, STORE)                                                        \
static void NAME(const T *x, const T *w, const T *b, T *y, int64_t rows, int64_t n,       \
                 float eps) {                                                             \
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {                                  \
        vf acc = {0};                                                                     \
        for (int64_t i = 0; i < n; i += LANES) acc += LOAD(x + i);                        \
        const float mean = total(acc) / (float)n;                                         \
        acc = (vf){0};                                                                    \
        for (int64_t i = 0; i < n; i += LANES) {                                          \
            const vf d = LOAD(x + i) - mean;                                              \
            acc += d * d;                                                                 \
        }                                                                                 \
        const float rstd = 1.0f / sqrtf(total(acc) / (float)n + eps);                     \
        for (int64_t i = 0; i < n; i += LANES) {                                          \
            const vf v = (LOAD(x + i) - mean) * rstd;                                     \
            STORE(y + i, w == NULL ? v : v * LOAD(w + i) + LOAD(b + i));                  \
        }                                                                                 \
    }                                                                                     \
}

NORM(norm_f32, float, load_f32, store_f32)
NORM(norm_bf16, uint16_t, load_bf16, store_bf16)

/* y = w * T(x * rsqrt(mean(x^2) + eps)) per row of n (a multiple of LANES), in float32:
   transformers' LlamaRMSNorm, the normalized row rounded to T before the weight. */
#define RMS(NAME, T, LOAD, ROUND, STORE)                                                  \
static void NAME(const T *x, const T *w, T *y, int64_t rows, int64_t n, float eps,        \
                 int threads) {                                                           \
    _Pragma("omp parallel for num_threads(threads) if (threads > 1)")                     \
    for (int64_t r = 0; r < rows; r++) {                                                  \
        const T *xr = x + r * n;                                                          \
        vf acc = {0};                                                                     \
        for (int64_t i = 0; i < n; i += LANES) { const vf v = LOAD(xr + i); acc += v * v; } \
        const float scale = 1.0f / sqrtf(total(acc) / (float)n + eps);                    \
        for (int64_t i = 0; i < n; i += LANES)                                            \
            STORE(y + r * n + i, ROUND(LOAD(xr + i) * scale) * LOAD(w + i));              \
    }                                                                                     \
}

RMS(rms_f32, float, load_f32, same_f32, store_f32)
RMS(rms_bf16, uint16_t, load_bf16, round_bf16, store_bf16)

int rms_norm(const void *x, const void *w, void *y, int64_t rows, int64_t n, float eps,
             int bf16, int threads) {
    if (bf16) rms_bf16(x, w, y, rows, n, eps, threads);
    else rms_f32(x, w, y, rows, n, eps, threads);
    return 0;
}

int layer_norm(const void *x, const void *w, const void *b, void *y, int64_t rows, int64_t n,
               float eps, int bf16) {
    if (bf16) norm_bf16(x, w, b, y, rows, n, eps);
    else norm_f32(x, w, b, y, rows, n, eps);
    return 0;
}
"""


@cache
def _library() -> ctypes.CDLL | None:
    """Compiles (once per source and flags) and loads the kernel; None when it cannot."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
    lib = cpu_kernels.build_openmp("layer_norm", _SOURCE, argtypes)
    if lib is not None:
        lib.rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int,
                                 ctypes.c_int]
        lib.rms_norm.restype = ctypes.c_int
    return lib


def kernel_kind(x: Tensor, width: int, params: Sequence[Tensor], limit: float = MAX_ELEMENTS
                ) -> int | None:
    """The kernel's dtype code for normalizing `x` (up to `limit` elements) over its last
    dimension (`width`) with `params`, or None where torch's path must run."""
    kind = cpu_kernels.VECTOR_KINDS.get(x.dtype)
    if (kind is None or x.device.type != "cpu" or x.numel() > limit
            or x.dim() == 0 or x.shape[-1] != width or width % 16
            or any(p.dtype != x.dtype for p in params) or torch.is_grad_enabled()
            or _library() is None):
        return None
    return kind


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (same parameters and state dict) that normalizes inputs of up to
    MAX_ELEMENTS float32 or bf16 elements on the CPU in the calling thread (module
    docstring), over a last dimension that is a multiple of 16."""

    def forward(self, x: Tensor) -> Tensor:
        params = [p for p in (self.weight, self.bias) if p is not None]
        affine = len(params) == 2  # a weight without a bias: torch's path
        if (len(self.normalized_shape) != 1 or len(params) == 1
                or (kind := kernel_kind(x, self.normalized_shape[0], params)) is None):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        x = x.contiguous()
        y = torch.empty_like(x)
        _library().layer_norm(  # type: ignore[union-attr]
            x.data_ptr(), self.weight.data_ptr() if affine else None,
            self.bias.data_ptr() if affine else None, y.data_ptr(),
            x.numel() // x.shape[-1], x.shape[-1], self.eps, kind)
        return y


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 (as transformers' LlamaRMSNorm), of
    float32 or bf16 inputs on the CPU over a last dimension that is a multiple of 16: up to
    MAX_ELEMENTS in the calling thread (module docstring), larger ones (prompts) a share of
    the rows per OpenMP thread."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if (kind := kernel_kind(x, self.weight.shape[0], [self.weight], math.inf)) is None:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x32.to(x.dtype)  # type: ignore[no-any-return]
        x = x.contiguous()
        y = torch.empty_like(x)
        _library().rms_norm(  # type: ignore[union-attr]
            x.data_ptr(), self.weight.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1],
            x.shape[-1], self.eps, kind, cpu_kernels.threads_for(x.numel()))
        return y
