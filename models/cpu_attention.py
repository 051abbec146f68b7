"""A fused paged decode-attention kernel for the CPU, in C, compiled once on first use.

torch has no paged attention on the CPU: the plain-torch `paged` path computes its scores
as sampled dot products (one small gathered dot per (sequence, head, position)), which at
short contexts runs several times slower than reading the KV once (docs/results.md), and
in bf16 without AVX-512 BF16 each product converts element by element. This
kernel reads each sequence's K and V rows once through its block table, token by token,
accumulates in float32 (bf16 values are widened exactly) and rounds the output once. Given
this step's K/V, each work item first writes its sequence's new row (rounded to the cache's
dtype, as `write_kv` would), so that a decode step makes no separate pass over the cache;
queries may be float32 over a bf16 cache (models that keep activations float32). With
grouped-query attention each K/V row is read once for all the query heads that share it.
Work items are whole sequences (single KV heads when the batch is small), handed out to
`torch.get_num_threads()` threads of torch's own OpenMP pool by a shared counter. The
vectors are as wide as the CPU's registers: 16 floats where it has AVX-512 (and head_dim
is a multiple of 32), else 8.

Optional, as the plain-torch path stays the reference: `decode` returns None when the
kernel cannot run (no C compiler, another dtype or device, a head_dim not a multiple of
16), and the caller falls back. Built and cached by `models.cpu_kernels` (ASERVE_CPU_KERNELS=0
disables it).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import Tensor

from models import cpu_bf16_attention, cpu_isa, cpu_kernels, cpu_mha_decode

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
LANES = 8  # floats per AVX2 register; head_dim must be a multiple of 2 * LANES
WIDE_LANES = 16  # floats per AVX-512 register, used where the CPU has it and head_dim allows
WIDE_LEVELS = ("AMX", "AVX-512-bf16", "AVX-512")  # cpu_isa levels with 512-bit registers

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef LANES
#define LANES 8  /* float lanes per vector: 8 (AVX2 register) or 16 (AVX-512 register) */
#endif

typedef struct {
    const void *q;             /* [num_seqs, heads * rep, dim], sequences q_stride apart */
    const void *k_new, *v_new; /* this step's [num_seqs, heads, dim] K/V (q's dtype), or NULL */
    int64_t q_stride, k_stride, v_stride;  /* elements between sequences */
    const void *k;             /* layer's K of block 0; V sits v_offset elements further */
    int64_t v_offset, block_stride;   /* elements */
    const int64_t *tables;     /* [num_seqs, width] */
    const int64_t *lens;       /* [num_seqs] */
    int64_t width, num_seqs, heads, rep, dim, block_size;  /* heads: the cache's KV heads */
    float scale;
    void *out;                 /* [num_seqs, heads * rep, dim] contiguous, q's dtype */
    int64_t max_len, group;    /* group: KV heads per work item (divides heads) */
    int64_t next;              /* next work item, shared by the workers */
} Job;

/* GCC/Clang vector extensions: LANES float lanes, one register under -march=native. */
typedef float fvec __attribute__((vector_size(4 * LANES)));
typedef uint16_t hvec __attribute__((vector_size(2 * LANES)));
typedef uint32_t uvec __attribute__((vector_size(4 * LANES)));
typedef float f32x8 __attribute__((vector_size(32)));

static inline fvec load_f32(const float *p) { fvec v; memcpy(&v, p, sizeof v); return v; }

static inline fvec load_bf16(const uint16_t *p) {  /* exact: bf16 is float's top half */
    hvec h; memcpy(&h, p, sizeof h);
    uvec w = __builtin_convertvector(h, uvec) << 16;
    fvec v; memcpy(&v, &w, sizeof v); return v;
}

static inline void store_f32(float *p, fvec v) { memcpy(p, &v, sizeof v); }

static inline void store_bf16(uint16_t *p, fvec v) {  /* round to nearest even, as torch */
    for (int j = 0; j < LANES; j++) {
        union { uint32_t u; float f; } c; c.f = v[j];
        p[j] = isnan(v[j]) ? 0x7fc0 : (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
    }
}

/* Two vectors from 2 * LANES cache elements, in the order that is cheapest to widen:
   float32 as it lies (elements 0..LANES-1, then the rest); bf16 split into its even and odd
   elements (one load, a shift and a mask: no lane crossing). The queries are laid out
   alike (POS), so every dot product still pairs the same elements; `_dot` and the p.v
   accumulators work in that order and the output is put back in place. */
static inline void load2_f32(const float *p, fvec *a, fvec *b) {
    *a = load_f32(p); *b = load_f32(p + LANES);
}
static inline void load2_bf16(const uint16_t *p, fvec *a, fvec *b) {
    uvec w; memcpy(&w, p, sizeof w);
    uvec even = w << 16, odd = w & 0xffff0000u;
    memcpy(a, &even, sizeof *a); memcpy(b, &odd, sizeof *b);
}
#define POS_f32(e) (e)
#define POS_bf16(e) (((e) & 1) * LANES + ((e) >> 1))
static inline float widen_f32(const float *p) { return *p; }
static inline float widen_bf16(const uint16_t *p) {
    union { uint32_t u; float f; } c; c.u = (uint32_t)*p << 16; return c.f;
}

static inline f32x8 fold8(fvec v) {  /* LANES lanes added pairwise down to 8 */
#if LANES == 8
    return v;
#else
    f32x8 lo, hi; memcpy(&lo, &v, sizeof lo); memcpy(&hi, (char *)&v + sizeof lo, sizeof hi);
    return lo + hi;
#endif
}

static inline float sum8(f32x8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

typedef float f32x4 __attribute__((vector_size(16)));
#ifdef __clang__
#define EVENS(a, b) __builtin_shufflevector(a, b, 0, 2, 4, 6)
#define ODDS(a, b) __builtin_shufflevector(a, b, 1, 3, 5, 7)
#else
typedef int32_t i32x4 __attribute__((vector_size(16)));
#define EVENS(a, b) __builtin_shuffle(a, b, (i32x4){0, 2, 4, 6})
#define ODDS(a, b) __builtin_shuffle(a, b, (i32x4){1, 3, 5, 7})
#endif

static inline f32x4 halves(f32x8 v) {  /* (v0 + v4, v1 + v5, v2 + v6, v3 + v7) */
    f32x4 lo, hi; memcpy(&lo, &v, sizeof lo); memcpy(&hi, (char *)&v + sizeof lo, sizeof hi);
    return lo + hi;
}

/* Asks for the `g * dim` elements of each of a block's `bs` token rows (`row` elements
   apart) ahead of their use. A sequence's blocks lie far apart in the cache (every layer's
   K and V of a block sit between them), and the hardware prefetchers stop at each 4 KiB
   page, so without this every block starts with loads that wait on memory. The lines go
   to L2 (prefetcht1): a block's worth of L1 prefetches fills the L1's few miss buffers and
   stalls the loads of the block being read. */
static inline void prefetch_block(const char *p, int64_t bs, int64_t row_bytes,
                                  int64_t bytes) {
    for (int64_t t = 0; t < bs; t++, p += row_bytes)
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
}

/* exp of each of n floats, in place, in a loop the compiler vectorizes: 2^k * exp(r) with
   r = x - k ln 2 (|r| <= ln 2 / 2, ln 2 in two parts) and Cephes' single-precision
   polynomial for exp(r), within about one ulp of expf. Inputs below -87.3 give the smallest
   normal float (their weights are zero to float precision); NaN stays NaN. */
static inline void exp_all(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float v = x[i], c = v < -87.33654f ? -87.33654f : v > 88.37626f ? 88.37626f : v;
        float k = (c * 1.44269504f + 12582912.0f) - 12582912.0f;  /* round to nearest */
        float r = c - k * 0.693359375f + k * 2.12194440e-4f;
        float p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = p * r * r + r + 1.0f;
        int32_t bits = ((int32_t)k + 127) << 23;
        float scale; memcpy(&scale, &bits, sizeof scale);
        x[i] = v != v ? v : p * scale;
    }
}

/* (sum(a), sum(b), sum(c), sum(d)), each added in sum8(fold8(.))'s order, in a few shuffles */
static inline f32x4 sum4(fvec a, fvec b, fvec c, fvec d) {
    f32x4 a4 = halves(fold8(a)), b4 = halves(fold8(b)), c4 = halves(fold8(c));
    f32x4 d4 = halves(fold8(d));
    f32x4 ab = EVENS(a4, b4) + ODDS(a4, b4), cd = EVENS(c4, d4) + ODDS(c4, d4);
    return EVENS(ab, cd) + ODDS(ab, cd);
}

/* One work item = one sequence and a group of `group` adjacent KV heads with their `rep`
   query heads each (grouped-query attention: query head j reads KV head j / rep), read
   token by token (each token's K/V of the group is one contiguous run): first this step's
   K/V of the group are written at position len - 1 (when k_new is set), then scores,
   softmax and the weighted sum of V; float32 throughout. Queries and output are QT
   (QLOAD, QSTORE), the cache T (LOAD, STORE). `scores` holds group * rep * max_len floats,
   position-major (the score of position p and query head h at p * group * rep + h).
   The loads of K and V are what a decode step waits for: both passes stream rows in
   memory order, once for all the query heads that share them, and keep several
   independent chains in flight, so that the arithmetic hides under the loads. q.k takes
   four (token, query head) pairs at a time, four dot products whose sums reduce together
   (`sum4`); p.v takes four tokens at a time, so that each accumulator is read and written
   once per four rows. Every sum is formed in the same order as one pair or one token at a
   time would form it. */
/* the next (token, query head) pair of q.k: query head h, the r-th of its KV head, whose
   row kh is; after the last head, the first head of the next token (no division) */
#define NEXT_PAIR(h, r, kh)                                                             \
    do {                                                                                \
        h++;                                                                            \
        if (++r == rep) r = 0, kh += dim;                                               \
        if (h == gq) h = 0, kh += row - g * dim;                                        \
    } while (0)

#define KERNEL(NAME, QT, QLOAD, QSTORE, QWIDEN, T, LOAD2, STORE, POS)                   \
static inline fvec NAME##_dot(const T *k, const fvec *q, int64_t chunks) {              \
    fvec a, b;                                                                          \
    LOAD2(k, &a, &b);                                                                   \
    fvec even = a * q[0], odd = b * q[1];                                               \
    for (int64_t c = 1; c < chunks; c++) {                                              \
        LOAD2(k + c * 2 * LANES, &a, &b);                                               \
        even += a * q[2 * c];                                                           \
        odd += b * q[2 * c + 1];                                                        \
    }                                                                                   \
    return even + odd;                                                                  \
}                                                                                       \
static void NAME(Job *job, float *scores) {                                             \
    T *kbase = (T *)job->k;                                                             \
    const int64_t heads = job->heads, rep = job->rep, dim = job->dim, vecs = dim / LANES; \
    const int64_t chunks = vecs / 2, bs = job->block_size, row = heads * dim;           \
    const int64_t g = job->group, gq = g * rep, groups = heads / g;                     \
    fvec qv[gq * vecs], acc[gq * vecs];                                                 \
    float peak[gq], total[gq], flat[dim];                                               \
    for (;;) {                                                                          \
        int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);            \
        if (item >= job->num_seqs * groups) return;                                     \
        int64_t seq = item / groups, h0 = item % groups * g, len = job->lens[seq];      \
        const int64_t *table = job->tables + seq * job->width;                          \
        if (job->k_new != NULL) {                                                       \
            const int64_t p = len - 1;                                                  \
            T *kw = kbase + table[p / bs] * job->block_stride + p % bs * row + h0 * dim; \
            const QT *kn = (const QT *)job->k_new + seq * job->k_stride + h0 * dim;     \
            const QT *vn = (const QT *)job->v_new + seq * job->v_stride + h0 * dim;     \
            for (int64_t i = 0; i < g * vecs; i++) {                                    \
                STORE(kw + i * LANES, QLOAD(kn + i * LANES));                           \
                STORE(kw + job->v_offset + i * LANES, QLOAD(vn + i * LANES));           \
            }                                                                           \
        }                                                                               \
        const QT *q = (const QT *)job->q + seq * job->q_stride + h0 * rep * dim;        \
        for (int64_t h = 0; h < gq; h++) {                                              \
            float *qh = (float *)(qv + h * vecs);                                       \
            for (int64_t e = 0; e < dim; e++)                                           \
                qh[e / (2 * LANES) * 2 * LANES + POS(e % (2 * LANES))] =                \
                    QWIDEN(q + h * dim + e) * job->scale;                               \
        }                                                                               \
        for (int64_t p0 = 0; p0 < len; p0 += bs) {                                      \
            const T *k = kbase + table[p0 / bs] * job->block_stride + h0 * dim;         \
            if (p0 + bs < len)                                                          \
                prefetch_block((const char *)(kbase + table[p0 / bs + 1]                \
                                              * job->block_stride + h0 * dim),          \
                               bs, row * sizeof(T), g * dim * sizeof(T));               \
            const int64_t pairs = (len - p0 < bs ? len - p0 : bs) * gq;                 \
            float *s = scores + p0 * gq;                                                \
            /* pair j = (token t, query head h = its KV head's r-th); kh: the KV row */ \
            int64_t j = 0, h = 0, r = 0;                                                \
            const T *kh = k;                                                            \
            for (; j + 4 <= pairs; j += 4) {                                            \
                fvec d[4];                                                              \
                for (int u = 0; u < 4; u++) {                                           \
                    d[u] = NAME##_dot(kh, qv + h * vecs, chunks);                       \
                    NEXT_PAIR(h, r, kh);                                                \
                }                                                                       \
                const f32x4 four = sum4(d[0], d[1], d[2], d[3]);                        \
                memcpy(s + j, &four, sizeof four);                                      \
            }                                                                           \
            for (; j < pairs; j++) {                                                    \
                s[j] = sum8(fold8(NAME##_dot(kh, qv + h * vecs, chunks)));              \
                NEXT_PAIR(h, r, kh);                                                    \
            }                                                                           \
        }                                                                               \
        for (int64_t h = 0; h < gq; h++) peak[h] = -INFINITY, total[h] = 0;             \
        for (int64_t p = 0; p < len; p++)                                               \
            for (int64_t h = 0; h < gq; h++)                                            \
                if (scores[p * gq + h] > peak[h]) peak[h] = scores[p * gq + h];         \
        for (int64_t p = 0; p < len; p++)                                               \
            for (int64_t h = 0; h < gq; h++) scores[p * gq + h] -= peak[h];             \
        exp_all(scores, len * gq);                                                      \
        for (int64_t p = 0; p < len; p++)                                               \
            for (int64_t h = 0; h < gq; h++) total[h] += scores[p * gq + h];            \
        for (int64_t i = 0; i < gq * vecs; i++) acc[i] = (fvec){0};                     \
        for (int64_t p0 = 0; p0 < len; p0 += bs) {                                      \
            const T *v = kbase + job->v_offset + table[p0 / bs] * job->block_stride     \
                         + h0 * dim;                                                    \
            if (p0 + bs < len)                                                          \
                prefetch_block((const char *)(kbase + job->v_offset + table[p0 / bs + 1] \
                                              * job->block_stride + h0 * dim),          \
                               bs, row * sizeof(T), g * dim * sizeof(T));               \
            const float *w = scores + p0 * gq;                                          \
            const int64_t n = len - p0 < bs ? len - p0 : bs;                            \
            int64_t t = 0;                                                              \
            for (; t + 4 <= n; t += 4, v += 4 * row, w += 4 * gq)                       \
                for (int64_t h = 0; h < gq; h++) {                                      \
                    const float w0 = w[h], w1 = w[gq + h], w2 = w[2 * gq + h];          \
                    const float w3 = w[3 * gq + h];                                     \
                    const T *vh = v + h / rep * dim;                                    \
                    for (int64_t c = 0; c < chunks; c++) {                              \
                        const T *vc = vh + c * 2 * LANES;                               \
                        fvec *ac = acc + h * vecs + 2 * c, a0 = ac[0], a1 = ac[1], x, y; \
                        LOAD2(vc, &x, &y); a0 += x * w0; a1 += y * w0;                  \
                        LOAD2(vc + row, &x, &y); a0 += x * w1; a1 += y * w1;            \
                        LOAD2(vc + 2 * row, &x, &y); a0 += x * w2; a1 += y * w2;        \
                        LOAD2(vc + 3 * row, &x, &y); a0 += x * w3; a1 += y * w3;        \
                        ac[0] = a0, ac[1] = a1;                                         \
                    }                                                                   \
                }                                                                       \
            for (; t < n; t++, v += row, w += gq)                                       \
                for (int64_t h = 0; h < gq; h++)                                        \
                    for (int64_t c = 0; c < chunks; c++) {                              \
                        fvec x, y, *ac = acc + h * vecs + 2 * c;                        \
                        LOAD2(v + h / rep * dim + c * 2 * LANES, &x, &y);               \
                        ac[0] += x * w[h], ac[1] += y * w[h];                           \
                    }                                                                   \
        }                                                                               \
        QT *out = (QT *)job->out + (seq * heads + h0) * rep * dim;                      \
        for (int64_t h = 0; h < gq; h++) {                                              \
            const float *ah = (const float *)(acc + h * vecs);                          \
            for (int64_t e = 0; e < dim; e++)                                           \
                flat[e] = ah[e / (2 * LANES) * 2 * LANES + POS(e % (2 * LANES))];       \
            for (int64_t i = 0; i < vecs; i++)                                          \
                QSTORE(out + h * dim + i * LANES, load_f32(flat + i * LANES) / total[h]); \
        }                                                                               \
    }                                                                                   \
}

KERNEL(decode_f32, float, load_f32, store_f32, widen_f32, float, load2_f32, store_f32, POS_f32)
KERNEL(decode_bf16, uint16_t, load_bf16, store_bf16, widen_bf16, uint16_t, load2_bf16, store_bf16,
       POS_bf16)
KERNEL(decode_f32_bf16, float, load_f32, store_f32, widen_f32, uint16_t, load2_bf16, store_bf16,
       POS_bf16)

enum { F32 = 0, BF16 = 1, F32_OVER_BF16 = 2 };  /* (queries, cache) dtypes */

/* One worker's share of `job` (work items from the shared counter); 0, or 1 when its
   scores buffer could not be allocated. */
static int work(Job *job, int kind) {
    int64_t len = job->max_len > 0 ? job->max_len : 1;
    float *scores = malloc(sizeof(float) * job->group * job->rep * len);
    if (scores == NULL) return 1;
    if (kind == BF16) decode_bf16(job, scores);
    else if (kind == F32_OVER_BF16) decode_f32_bf16(job, scores);
    else decode_f32(job, scores);
    free(scores);
    return 0;
}

/* Returns 0 on success, -1 when memory ran out (the caller falls back; the K/V writes may
   then have happened, which the caller's own write repeats). The workers are OpenMP's:
   the process already runs torch's OpenMP runtime, so this kernel and torch's operators
   share one pool of threads instead of contending for the cores. */
int paged_decode(const void *q, const void *k_new, const void *v_new, int64_t q_stride,
                 int64_t k_stride, int64_t v_stride, const void *k, int64_t v_offset,
                 int64_t block_stride, const int64_t *tables, int64_t width,
                 const int64_t *lens, int64_t num_seqs, int64_t heads, int64_t rep,
                 int64_t dim, int64_t block_size, int64_t max_len, float scale, void *out,
                 int kind, int num_threads) {
    /* whole sequences when there are enough to share out, else one KV head per item */
    int64_t group = num_seqs >= 4 * num_threads ? heads : 1;
    Job job = {q, k_new, v_new, q_stride, k_stride, v_stride, k, v_offset, block_stride,
               tables, lens, width, num_seqs, heads, rep, dim, block_size, scale, out,
               max_len, group, 0};
    int failed = 0;
    #pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(|: failed)
    failed |= work(&job, kind);
    return failed ? -1 : 0;
}
"""


@cache
def _library(lanes: int = LANES) -> ctypes.CDLL | None:
    """Compiles (once per source, vector width and flags) and loads the kernel; None when
    it cannot."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    source = f"#define LANES {lanes}\n{_SOURCE}"
    argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64,
                i64, i64, ctypes.c_float, ptr, ctypes.c_int, ctypes.c_int]
    return cpu_kernels.build_openmp("paged_decode", source, argtypes)


def lanes_for(head_dim: int) -> int:
    """The vector width the kernel uses on this CPU for `head_dim`: AVX-512 registers where
    the CPU has them and `head_dim` fills them, else AVX2's."""
    wide = cpu_isa.detect().level in WIDE_LEVELS and head_dim % (2 * WIDE_LANES) == 0
    return WIDE_LANES if wide else LANES


def is_supported(kv_cache: Tensor) -> bool:
    """Whether `decode` runs for this cache (and the kernel builds on this machine)."""
    return (kv_cache.device.type == "cpu" and kv_cache.dtype in KERNEL_DTYPES
            and kv_cache.shape[-1] % (2 * LANES) == 0 and kv_cache.is_contiguous()
            and _library(lanes_for(kv_cache.shape[-1])) is not None)


# (queries, cache) dtypes -> the kernel's `kind`: same dtype, or float32 queries over a
# bf16 cache (models that keep activations float32 between float32 matmuls)
_KINDS = {(torch.float32, torch.float32): 0, (torch.bfloat16, torch.bfloat16): 1,
          (torch.float32, torch.bfloat16): 2}


def heads_contiguous(t: Tensor) -> Tensor:
    """`t` (`[num_seqs, heads, dim]`) with contiguous heads; sequences may be strided."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def decode(q: Tensor, kv_cache: Tensor, layer: int, block_tables: Tensor, seq_lens: Tensor,
           max_seq_len: int, scale: float, new_kv: tuple[Tensor, Tensor] | None = None,
           lanes: int | None = None) -> Tensor | None:
    """`[num_seqs, heads, dim]` attention (q's dtype) of one query per sequence over its
    first `seq_lens[i]` cached tokens of `layer` (blocks `block_tables[i]`). q may have a
    multiple of the cache's KV heads (grouped-query attention: query head j reads KV head
    j // (heads / kv_heads)). With `new_kv` (this step's `[num_seqs, kv_heads, dim]` K and
    V, q's dtype), each sequence first writes them at its position `seq_lens[i] - 1`,
    rounded to the cache's dtype, as `write_kv` does. q, K and V may be views of one fused
    projection. `lanes` forces a vector width (LANES or WIDE_LANES; default `lanes_for`);
    without it, bf16 queries over a bf16 cache go to `cpu_bf16_attention.decode` (grouped)
    or `cpu_mha_decode.decode` (one query head per KV head) where the CPU has a native bf16
    dot product.
    None when unsupported (`is_supported`, or a dtype pair the kernel lacks), so that the
    caller takes its reference path (and its own KV write)."""
    if lanes is None and q.dtype == kv_cache.dtype == torch.bfloat16:
        # NOTE: grouped queries: the bf16 kernel reads each K/V row once for all the heads
        # that share it, where this one widens it once per head; one query head per KV
        # head: a single pass with the next tile prefetched streams the cache faster
        out = (cpu_bf16_attention.decode(q, kv_cache, layer, block_tables, seq_lens,
                                         max_seq_len, scale, new_kv)
               if q.shape[1] > kv_cache.shape[4] else
               cpu_mha_decode.decode(q, kv_cache, layer, block_tables, seq_lens, max_seq_len,
                                     scale, new_kv))
        if out is not None:
            return out
    kind = _KINDS.get((q.dtype, kv_cache.dtype))
    _, num_layers, _, block_size, kv_heads, head_dim = kv_cache.shape
    if kind is None or q.shape[1] % kv_heads or not is_supported(kv_cache):
        return None
    lib = _library(lanes or lanes_for(head_dim))
    if lib is None or head_dim % (2 * (lanes or LANES)):
        return None
    q = heads_contiguous(q)  # [num_seqs, heads, dim]
    k_new = v_new = None
    if new_kv is not None:
        # [num_seqs, kv_heads, dim] each
        k_new, v_new = (heads_contiguous(t.to(q.dtype)) for t in new_kv)
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()  # long
    out = torch.empty(q.shape, dtype=q.dtype)  # [num_seqs, heads, dim]
    block_elems = block_size * kv_heads * head_dim  # one K (or V) block of one layer
    k_ptr = kv_cache.data_ptr() + layer * 2 * block_elems * kv_cache.element_size()
    status = lib.paged_decode(
        q.data_ptr(), None if k_new is None else k_new.data_ptr(),
        None if v_new is None else v_new.data_ptr(), q.stride(0),
        0 if k_new is None else k_new.stride(0), 0 if v_new is None else v_new.stride(0),
        k_ptr, block_elems, num_layers * 2 * block_elems, tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), q.shape[0], kv_heads, q.shape[1] // kv_heads, head_dim, block_size,
        max_seq_len, scale, out.data_ptr(), kind, torch.get_num_threads())
    return out if status == 0 else None
