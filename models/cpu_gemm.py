"""A float32 GEMM for linear layers on the CPU, in C, compiled once on first use.

`out = x @ weight.T + bias`, then ReLU or `+ residual`, from a weight packed once into
16-column panels (`pack`). On an AVX2 CPU torch's GEMMs at decode shapes
(tens of rows against the weight matrices and the LM head) reach well below the rate of a
large square matmul (oneDNN and MKL alike); this kernel's 6 x 16 register
tile (12 accumulators, BLIS's Haswell shape) over K blocks of 256 that stay in L1 gets
closer. Work items are (block of up to 192 rows, panel) pairs; the caller and
`torch.get_num_threads() - 1` helper threads, kept parked between calls, claim them from
the two ends of the list, so that each walks consecutive panels and prefetches the one it
takes next. The rows are spread evenly over the register tiles (64 = 9 x 6 + 2 x 5), and
the last K block adds the bias, applies ReLU or adds the residual while the sums are still
in registers, writing the output once.

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
    int64_t next;        /* the unclaimed work items (see `claim`) */
} Gemm;

/* Where a finished tile goes: out (row stride ldo) = tile + bias, then ReLU or + res. */
typedef struct {
    float *out;
    int64_t ldo;
    const float *bias, *res;  /* at the tile's first column and row, or NULL */
    int relu;
} Epi;

typedef int32_t i32x8 __attribute__((vector_size(32)));

static inline f32x8 finish(f32x8 v, int relu, const float *bias, const float *res) {
    if (bias != NULL) v += ld(bias);
    if (relu) {  /* max(v, 0) that keeps NaN, as torch */
        const i32x8 keep = (v > 0.0f) | (v != v);
        v = (f32x8)((i32x8)v & keep);
    }
    return res != NULL ? v + ld(res) : v;
}

/* c (R x 16, row stride NR) = (first ? 0 : c) + a (R rows, stride lda) [:, 0:kc] @ b (kc x
   16); with `e` (the last K block), the sums go through `finish` straight into e->out while
   they are still in registers, instead of back into c. */
#define MICRO(R)                                                                        \
static void micro_##R(int64_t kc, const float *a, int64_t lda, const float *b, float *c, \
                      int first, const Epi *e) {                                        \
    f32x8 c0[R], c1[R];                                                                 \
    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                               \
        c0[r] = first ? (f32x8){0} : ld(c + r * NR);                                    \
        c1[r] = first ? (f32x8){0} : ld(c + r * NR + 8);                                \
    }                                                                                   \
    _Pragma("GCC unroll 4") for (int64_t p = 0; p < kc; p++) {                          \
        const f32x8 b0 = ld(b + p * NR), b1 = ld(b + p * NR + 8);                       \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                           \
            const float s = a[r * lda + p];                                             \
            const f32x8 av = {s, s, s, s, s, s, s, s};                                  \
            c0[r] += av * b0; c1[r] += av * b1;                                         \
        }                                                                               \
    }                                                                                   \
    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                               \
        if (e == NULL) {                                                                \
            st(c + r * NR, c0[r]); st(c + r * NR + 8, c1[r]);                           \
            continue;                                                                   \
        }                                                                               \
        const float *res = e->res ? e->res + r * e->ldo : NULL;                         \
        st(e->out + r * e->ldo, finish(c0[r], e->relu, e->bias, res));                  \
        st(e->out + r * e->ldo + 8, finish(c1[r], e->relu, e->bias ? e->bias + 8 : NULL, \
                                           res ? res + 8 : NULL));                      \
    }                                                                                   \
}
MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6)
typedef void (*micro_fn)(int64_t, const float *, int64_t, const float *, float *, int,
                         const Epi *);
static const micro_fn MICROS[MR + 1] = {0, micro_1, micro_2, micro_3, micro_4, micro_5,
                                        micro_6};

/* The job and its completion, on the heap: a helper thread that starts late (a busy
   machine) finds no work left and must not touch the caller's stack after it returned. */
typedef struct {
    Gemm g;
    int64_t items, done;  /* work items; finished ones */
    int refs;             /* threads still holding the job (the caller included) */
    int started;          /* threads that joined (the caller first) */
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

/* The next work item, or -1: g.next holds the unclaimed items [lo, hi) as hi << 32 | lo.
   Even threads (the caller) claim from the front, odd ones from the back, so that each
   walks consecutive panels (the one it prefetches comes next) and they meet in the middle
   whatever each thread's speed. */
static int64_t claim(Shared *s, int from_back) {
    uint64_t cur = __atomic_load_n((uint64_t *)&s->g.next, __ATOMIC_RELAXED);
    for (;;) {
        const uint32_t lo = (uint32_t)cur, hi = (uint32_t)(cur >> 32);
        if (lo >= hi) return -1;
        const uint64_t want = from_back ? (uint64_t)(hi - 1) << 32 | lo
                                        : (uint64_t)hi << 32 | (lo + 1);
        if (__atomic_compare_exchange_n((uint64_t *)&s->g.next, &cur, want, 1,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return from_back ? hi - 1 : lo;
    }
}

static void run(Shared *s, int from_back) {
    Gemm *g = &s->g;
    const int64_t panels = (g->n + NR - 1) / NR, k = g->k, n = g->n;
    const int64_t step = NR * (g->w_bf16 ? 2 : 4);  /* bytes of one K row of a panel */
    float tile[MB * NR] __attribute__((aligned(64)));
    float wide[KC * NR] __attribute__((aligned(64)));  /* a bf16 K block, widened */
    for (int64_t item; (item = claim(s, from_back)) >= 0;) {
        const int64_t i0 = item / panels * MB, j = item % panels;
        const int64_t j_next = from_back ? j - 1 : j + 1;  /* the panel it likely takes next */
        const int64_t m = g->m - i0 < MB ? g->m - i0 : MB, tiles = (m + MR - 1) / MR;
        const int64_t n0 = j * NR, cols = n - n0 < NR ? n - n0 : NR;
        const float *x = g->x + i0 * g->x_stride;
        const char *wp = (const char *)g->w + j * k * step;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t kc = k - k0 < KC ? k - k0 : KC;
            const int last = k0 + kc == k;
            /* the weights stream from memory: the panel's next K block (after the last, the
               first of panel j_next) goes towards L2 meanwhile, each row tile asking for its
               share of the lines */
            const char *next = !last ? wp + (k0 + KC) * step
                               : j_next >= 0 && j_next < panels ? wp + (j_next - j) * k * step
                               : NULL;
            const int64_t next_kc = !last ? (k - k0 - KC < KC ? k - k0 - KC : KC)
                                          : (k < KC ? k : KC);
            const int64_t lines = next == NULL ? 0 : (next_kc * step + 63) / 64;
            const float *b = (const float *)(wp + k0 * step);
            if (g->w_bf16) {  /* exact: bf16 is float's top half */
                const uint16_t *h = (const uint16_t *)(wp + k0 * step);
                uint32_t *u = (uint32_t *)wide;
                for (int64_t e = 0; e < kc * NR; e++) u[e] = (uint32_t)h[e] << 16;
                b = wide;
            }
            for (int64_t t = 0; t < tiles; t++) {
                for (int64_t l = lines * t / tiles; l < lines * (t + 1) / tiles; l++)
                    __builtin_prefetch(next + l * 64, 0, 2);
                /* rows spread evenly over the tiles (64 = 9 x 6 + 2 x 5, not 10 x 6 + 4) */
                const int64_t i = t * (m / tiles) + (t < m % tiles ? t : m % tiles);
                const int64_t rows = m / tiles + (t < m % tiles);
                const Epi e = {g->out + (i0 + i) * n + n0, n, g->bias ? g->bias + n0 : NULL,
                               g->res ? g->res + (i0 + i) * n + n0 : NULL, g->relu};
                MICROS[rows](kc, x + i * g->x_stride + k0, g->x_stride, b, tile + i * NR,
                             k0 == 0, last && cols == NR ? &e : NULL);
            }
        }
        for (int64_t i = 0; cols < NR && i < m; i++) {  /* a last, partial panel */
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

/* Helper threads kept between calls (a thread's start costs tens of microseconds, and a
   decode step makes dozens of calls), parked on `wake` until a caller posts a job. One job at a
   time: a caller that finds another's job posted (calls from two threads) works alone. */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    Shared *job;      /* the posted job, or NULL */
    uint64_t posted;  /* jobs posted so far: a helper joins each at most once */
    int wanted;       /* helpers the posted job still asks for */
    int threads;      /* helpers started */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0};

/* Iterations a thread spins for its next job (or a caller for its last items) before it
   sleeps, as OpenMP's threads do (aserve/__init__.py): GOMP_SPINCOUNT, 10000 unset, none
   under OMP_WAIT_POLICY=PASSIVE. Waking a sleeping thread costs up to 100 us on a virtual
   machine, and a decode step makes dozens of calls. */
static long spin_count = 10000;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *helper(void *arg) {
    (void)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        if (pool.job == NULL || pool.posted == seen || pool.wanted == 0) {
            pthread_mutex_unlock(&pool.mu);
            for (long i = 0; i < spin_count
                             && __atomic_load_n(&pool.posted, __ATOMIC_ACQUIRE) == seen; i++)
                relax();
            pthread_mutex_lock(&pool.mu);
        }
        while (pool.job == NULL || pool.posted == seen || pool.wanted == 0)
            pthread_cond_wait(&pool.wake, &pool.mu);
        Shared *s = pool.job;
        seen = pool.posted;
        pool.wanted--;
        /* the caller holds its reference until it has taken the job back (under pool.mu) */
        __atomic_add_fetch(&s->refs, 1, __ATOMIC_ACQ_REL);
        pthread_mutex_unlock(&pool.mu);
        run(s, __atomic_fetch_add(&s->started, 1, __ATOMIC_RELAXED) % 2);
        release(s);
        pthread_mutex_lock(&pool.mu);
    }
    return NULL;
}

/* A forked child has none of the parent's helpers (and maybe a lock held by one of them). */
static void pool_lock(void) { pthread_mutex_lock(&pool.mu); }
static void pool_unlock(void) { pthread_mutex_unlock(&pool.mu); }
static void pool_reset(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.job = NULL;
    pool.wanted = pool.threads = 0;
}
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_init(void) {
    pthread_atfork(pool_lock, pool_unlock, pool_reset);
    const char *policy = getenv("OMP_WAIT_POLICY"), *count = getenv("GOMP_SPINCOUNT");
    if (policy != NULL && (strcmp(policy, "PASSIVE") == 0 || strcmp(policy, "passive") == 0))
        spin_count = 0;
    else if (count != NULL && strtol(count, NULL, 10) > 0)
        spin_count = strtol(count, NULL, 10);
}

/* Posts `s` for up to `helpers` helper threads (started as needed); returns whether posted. */
static int post(Shared *s, int helpers) {
    pthread_once(&pool_once, pool_init);
    pthread_mutex_lock(&pool.mu);
    const int posted = pool.job == NULL;
    if (posted) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        for (pthread_t thread; pool.threads < helpers; pool.threads++)
            if (pthread_create(&thread, &attr, helper, NULL) != 0) break;  /* fewer helpers */
        pthread_attr_destroy(&attr);
        pool.job = s;
        __atomic_add_fetch(&pool.posted, 1, __ATOMIC_RELEASE);  /* spinning helpers see it */
        pool.wanted = helpers;
        pthread_cond_broadcast(&pool.wake);
    }
    pthread_mutex_unlock(&pool.mu);
    return posted;
}

/* Takes the job back: helpers that wake later find nothing to join. */
static void retract(void) {
    pthread_mutex_lock(&pool.mu);
    pool.job = NULL;
    pool.wanted = 0;
    pthread_mutex_unlock(&pool.mu);
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
                  .items = (m + MB - 1) / MB * ((n + NR - 1) / NR), .done = 0, .refs = 1,
                  .started = 1};
    s->g.next = (int64_t)((uint64_t)s->items << 32);  /* all of [0, items) unclaimed */
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->finished, NULL);
    const int helpers = num_threads - 1 < s->items - 1 ? num_threads - 1 : (int)s->items - 1;
    const int posted = helpers > 0 && post(s, helpers);
    run(s, 0);
    if (posted) retract();
    for (long i = 0; i < spin_count && __atomic_load_n(&s->done, __ATOMIC_ACQUIRE) < s->items;
         i++)
        relax();
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
    ln_weight: Tensor | None = None if norm is None else norm.weight
    ln_bias: Tensor | None = None if norm is None else norm.bias
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
