"""A float32 GEMM for linear layers on the CPU, in C, compiled once on first use.

`out = x @ weight.T + bias`, then ReLU or `+ residual`, from a weight packed once into
16-column panels (`pack`). On the AVX2 CPU of issue 17 torch's GEMMs at decode shapes
(64 rows x 768-3072, the 50272-row LM head) reach 0.6-0.8x the rate of a large square
matmul (oneDNN and MKL alike, benchmarks/RESULTS.md §10); this kernel's 6 x 16 register
tile (12 accumulators, BLIS's Haswell shape) over K blocks of 256 that stay in L1 reaches
about that large-matmul rate at 64 rows. Work items are (block of up to 192 rows, panel)
pairs, handed out to `torch.get_num_threads()` threads by a shared counter; the epilogue
adds the bias, applies ReLU or adds the residual while the tile is still in cache.

Optional, as torch's GEMM stays the reference: `linear` returns None when the kernel cannot
run (no C compiler, not float32 on the CPU), and the caller falls back. Built and cached by
`models.cpu_kernels` (ASERVE_CPU_KERNELS=0 disables it).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import cpu_kernels

PANEL = 16  # output columns per packed panel (two 8-float AVX2 registers)

_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 16   /* columns per panel */
#define MR 6    /* rows per register tile */
#define KC 256  /* K per block: a panel's block (16 KB) stays in L1 across the row tiles */
#define MB 192  /* rows per work item (a multiple of MR): its x block stays in L2 */

typedef float f32x8 __attribute__((vector_size(32)));
static inline f32x8 ld(const float *p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }

typedef struct {
    const float *x;      /* [m, k] rows x_stride apart */
    int64_t x_stride, m, k, n;
    const void *w;       /* [ceil(n / 16), k, 16] panels, zero-padded columns */
    int w_bf16;          /* panels hold bf16 (widened exactly per K block), else float */
    const float *bias;   /* [n] or NULL */
    const float *res;    /* [m, n] contiguous, or NULL */
    float *out;          /* [m, n] contiguous */
    int relu;
    int64_t next;        /* next work item, shared by the workers */
} Gemm;

/* c (R x 16, row stride NR) += a (R rows, stride lda) [:, 0:kc] @ b (kc x 16) */
#define MICRO(R)                                                                        \
static void micro_##R(int64_t kc, const float *a, int64_t lda, const float *b, float *c, \
                      const char *next, int64_t next_step) {                             \
    f32x8 c0[R], c1[R];                                                                 \
    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                               \
        c0[r] = ld(c + r * NR); c1[r] = ld(c + r * NR + 8);                             \
    }                                                                                   \
    _Pragma("GCC unroll 4") for (int64_t p = 0; p < kc; p++) {                          \
        const f32x8 b0 = ld(b + p * NR), b1 = ld(b + p * NR + 8);                       \
        if (next != NULL) __builtin_prefetch(next + p * next_step, 0, 2);               \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                           \
            const float s = a[r * lda + p];                                             \
            const f32x8 av = {s, s, s, s, s, s, s, s};                                  \
            c0[r] += av * b0; c1[r] += av * b1;                                         \
        }                                                                               \
    }                                                                                   \
    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                               \
        st(c + r * NR, c0[r]); st(c + r * NR + 8, c1[r]);                               \
    }                                                                                   \
}
MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6)
typedef void (*micro_fn)(int64_t, const float *, int64_t, const float *, float *,
                         const char *, int64_t);
static const micro_fn MICROS[MR + 1] = {0, micro_1, micro_2, micro_3, micro_4, micro_5,
                                        micro_6};

/* The job and its completion, on the heap: a helper thread that starts late (a busy
   machine) finds no work left and must not touch the caller's stack after it returned. */
typedef struct {
    Gemm g;
    int64_t items, done;  /* work items; finished ones */
    int refs;             /* threads still holding the job (the caller included) */
    pthread_mutex_t mu;
    pthread_cond_t finished;
} Shared;

static void release(Shared *s) {
    if (__atomic_sub_fetch(&s->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->finished);
        free(s);
    }
}

static void run(Shared *s) {
    Gemm *g = &s->g;
    const int64_t panels = (g->n + NR - 1) / NR, k = g->k, n = g->n;
    const int64_t step = NR * (g->w_bf16 ? 2 : 4);  /* bytes of one K row of a panel */
    float tile[MB * NR] __attribute__((aligned(64)));
    float wide[KC * NR] __attribute__((aligned(64)));  /* a bf16 K block, widened */
    for (;;) {
        const int64_t item = __atomic_fetch_add(&g->next, 1, __ATOMIC_RELAXED);
        if (item >= s->items) return;
        const int64_t i0 = item / panels * MB, j = item % panels;
        const int64_t m = g->m - i0 < MB ? g->m - i0 : MB;
        const float *x = g->x + i0 * g->x_stride;
        const char *wp = (const char *)g->w + j * k * step;
        memset(tile, 0, sizeof(float) * m * NR);
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t kc = k - k0 < KC ? k - k0 : KC;
            /* the first row tile pulls the panel's next K block (or the next panel's first)
               towards L2 while the weights stream from memory */
            const char *next = k0 + KC < k ? wp + (k0 + KC) * step
                               : j + 1 < panels ? wp + k * step : NULL;
            const float *b = (const float *)(wp + k0 * step);
            if (g->w_bf16) {  /* exact: bf16 is float's top half */
                const uint16_t *h = (const uint16_t *)(wp + k0 * step);
                uint32_t *u = (uint32_t *)wide;
                for (int64_t e = 0; e < kc * NR; e++) u[e] = (uint32_t)h[e] << 16;
                b = wide;
            }
            for (int64_t i = 0; i < m; i += MR)
                MICROS[m - i < MR ? m - i : MR](kc, x + i * g->x_stride + k0, g->x_stride, b,
                                                tile + i * NR, i == 0 ? next : NULL, step);
        }
        const int64_t n0 = j * NR, cols = n - n0 < NR ? n - n0 : NR;
        for (int64_t i = 0; i < m; i++) {
            const float *t = tile + i * NR;
            float *o = g->out + (i0 + i) * n + n0;
            const float *r = g->res ? g->res + (i0 + i) * n + n0 : NULL;
            for (int64_t c = 0; c < cols; c++) {
                float v = t[c] + (g->bias ? g->bias[n0 + c] : 0.0f);
                if (g->relu && !(v > 0.0f)) v = v != v ? v : 0.0f;  /* keeps NaN, as torch */
                o[c] = r ? v + r[c] : v;
            }
        }
        if (__atomic_add_fetch(&s->done, 1, __ATOMIC_ACQ_REL) == s->items) {
            pthread_mutex_lock(&s->mu);
            pthread_cond_broadcast(&s->finished);
            pthread_mutex_unlock(&s->mu);
        }
    }
}

static void *helper(void *arg) {
    run(arg);
    release(arg);
    return NULL;
}

/* out[0:k] = LayerNorm(x[0:k]): mean, then variance, each summed in 8 float lanes (the
   lanes added pairwise), then (x * rstd - mean * rstd) * weight + bias, as torch's CPU kernel
   orders it. */
static inline float lanes(f32x8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* The sum of x[0:k] (mean NAN) or of its squared deviations from `mean`. */
static float lane_sum(const float *x, int64_t k, float mean) {
    const int squares = mean == mean;
    f32x8 acc = {0};
    float tail = 0.0f;
    int64_t c = 0;
    for (; c + 8 <= k; c += 8) {
        const f32x8 d = ld(x + c) - (squares ? mean : 0.0f);
        acc += squares ? d * d : d;
    }
    for (; c < k; c++) tail += squares ? (x[c] - mean) * (x[c] - mean) : x[c];
    return lanes(acc) + tail;
}

static void layer_norm_row(const float *x, int64_t k, const float *weight, const float *bias,
                           float eps, float *out) {
    const float mean = lane_sum(x, k, NAN) / (float)k;
    const float var = lane_sum(x, k, mean) / (float)k;
    const float rstd = 1.0f / sqrtf(var + eps), shift = -mean * rstd;
    for (int64_t c = 0; c < k; c++) {
        float v = x[c] * rstd + shift;
        out[c] = weight ? v * weight[c] + (bias ? bias[c] : 0.0f) : v;
    }
}

/* Returns 0, or -1 when out of memory (nothing computed). The caller works too and waits
   only for work items in progress: helpers that start late find none and exit alone.
   With `norm`, x's rows first go through a LayerNorm (ln_weight, ln_bias may be NULL),
   computed once by the caller into a scratch block that the work items then read. */
int gemm(const float *x, int64_t x_stride, int64_t m, int64_t k, int64_t n, const void *w,
         int w_bf16, const float *bias, const float *res, float *out, int relu, int norm,
         const float *ln_weight, const float *ln_bias, float ln_eps, int num_threads) {
    float *normed = NULL;
    if (norm) {
        normed = malloc(sizeof(float) * m * k);
        if (normed == NULL) return -1;
        for (int64_t i = 0; i < m; i++)
            layer_norm_row(x + i * x_stride, k, ln_weight, ln_bias, ln_eps, normed + i * k);
        x = normed;
        x_stride = k;
    }
    Shared *s = malloc(sizeof *s);
    if (s == NULL) {
        free(normed);
        return -1;
    }
    *s = (Shared){.g = {x, x_stride, m, k, n, w, w_bf16, bias, res, out, relu, 0},
                  .items = (m + MB - 1) / MB * ((n + NR - 1) / NR), .done = 0, .refs = 1};
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->finished, NULL);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int i = 1; i < num_threads && i < s->items; i++) {
        pthread_t thread;
        __atomic_add_fetch(&s->refs, 1, __ATOMIC_ACQ_REL);
        if (pthread_create(&thread, &attr, helper, s) != 0) {
            __atomic_sub_fetch(&s->refs, 1, __ATOMIC_ACQ_REL);
            break;  /* fewer helpers: the caller does the rest */
        }
    }
    pthread_attr_destroy(&attr);
    run(s);
    pthread_mutex_lock(&s->mu);
    while (__atomic_load_n(&s->done, __ATOMIC_ACQUIRE) < s->items)
        pthread_cond_wait(&s->finished, &s->mu);
    pthread_mutex_unlock(&s->mu);
    release(s);
    free(normed);  /* every work item is done: no helper reads x any more */
    return 0;
}
"""


@cache
def _library() -> ctypes.CDLL | None:
    """Compiles (once per source and flags) and loads the kernel; None when it cannot."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_kernels.build("gemm", _SOURCE, [ptr, i64, i64, i64, i64, ptr, ctypes.c_int,
                                               ptr, ptr, ptr, ctypes.c_int, ctypes.c_int,
                                               ptr, ptr, ctypes.c_float, ctypes.c_int])


def is_available() -> bool:
    """Whether the kernel builds on this machine (and is not switched off)."""
    return _library() is not None


def pack(weight: Tensor) -> Tensor:
    """`[out, in]` weight -> `[ceil(out / 16), in, 16]` panels (columns past `out` are
    zero): the layout `linear` reads. bf16 weights stay bf16 (half the bytes each step
    streams; widened exactly in the kernel), any other dtype becomes float32. The panels
    sit on transparent huge pages where Linux has them (`cpu_kernels.advise_huge_pages`)."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    w = weight.detach()
    w = w if w.dtype == torch.bfloat16 else w.float()
    padded = F.pad(w, (0, 0, 0, panels * PANEL - out_features))
    out = torch.empty(panels, in_features, PANEL, dtype=w.dtype)
    cpu_kernels.advise_huge_pages(out)  # streamed every step: few TLB misses
    return out.copy_(padded.view(panels, PANEL, in_features).transpose(1, 2))


def linear(x: Tensor, packed: Tensor, out_features: int, bias: Tensor | None = None,
           relu: bool = False, residual: Tensor | None = None,
           norm: nn.LayerNorm | None = None) -> Tensor | None:
    """`[rows, in]` float32 `x` @ the transpose of a `pack`ed weight + `bias` (float32), then
    ReLU (`relu`) or `+ residual` (`[rows, out]` float32): `[rows, out]` float32. With
    `norm` (a float32 LayerNorm over `in`), x's rows are normalized first, in the kernel's
    input pass: no separate torch op (each wakes torch's thread pool) and no tensor for
    them. None when the kernel cannot run (not built, not float32 on the CPU), so that the
    caller takes its torch path."""
    lib = _library()
    ln_weight, ln_bias = (None, None) if norm is None else (norm.weight, norm.bias)
    tensors = [x] + [t for t in (bias, residual, ln_weight, ln_bias) if t is not None]
    if (lib is None or packed.dtype not in (torch.float32, torch.bfloat16)
            or packed.device.type != "cpu"
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors)):
        return None
    if packed.shape[0] * PANEL < out_features or packed.shape[1] != x.shape[1]:
        raise ValueError(f"packed weight {tuple(packed.shape)} does not fit input "
                         f"{tuple(x.shape)} and {out_features} outputs")
    if x.stride(1) != 1:
        x = x.contiguous()
    if norm is not None and tuple(norm.normalized_shape) != (x.shape[1],):
        raise ValueError(f"LayerNorm over {tuple(norm.normalized_shape)} does not fit input "
                         f"{tuple(x.shape)}")
    bias, residual, ln_weight, ln_bias = (None if t is None else t.contiguous()
                                          for t in (bias, residual, ln_weight, ln_bias))
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    status = lib.gemm(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out_features,
             packed.data_ptr(), int(packed.dtype == torch.bfloat16),
             None if bias is None else bias.data_ptr(),
             None if residual is None else residual.data_ptr(), out.data_ptr(), int(relu),
             int(norm is not None), None if ln_weight is None else ln_weight.data_ptr(),
             None if ln_bias is None else ln_bias.data_ptr(),
             0.0 if norm is None else norm.eps, torch.get_num_threads())
    return out if status == 0 else None
