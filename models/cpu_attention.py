"""A fused paged decode-attention kernel for the CPU, in C, compiled once on first use.

torch has no paged attention on the CPU: the plain-torch `paged` path computes its scores
as sampled dot products (one small gathered dot per (sequence, head, position)), which at
short contexts runs several times slower than reading the KV once (docs/results.md), and
in bf16 without AVX-512 BF16 each product converts element by element. This
kernel reads each sequence's K and V rows once through its block table, token by token,
accumulates in float32 (bf16 values are widened exactly) and rounds the output once. Given
this step's K/V, each work item first writes its sequence's new row (rounded to the cache's
dtype, as `write_kv` would), so that a decode step makes no separate pass over the cache;
queries may be float32 over a bf16 cache (models that keep activations float32). Work
items are whole sequences (single heads when the batch is small), handed out to
`torch.get_num_threads()` threads by a shared counter.

Optional, as the plain-torch path stays the reference: `decode` returns None when the
kernel cannot run (no C compiler, another dtype or device, a head_dim not a multiple of
8), and the caller falls back. Built and cached by `models.cpu_kernels` (ASERVE_CPU_KERNELS=0
disables it).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import Tensor

from models import cpu_kernels

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
LANES = 8  # floats per AVX2 register: head_dim must be a multiple (opt: 64; opt-tiny: 16)

_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 8

typedef struct {
    const void *q;             /* [num_seqs, heads, dim] rows q_stride elements apart */
    const void *k_new, *v_new; /* this step's K/V rows like q (q's dtype), or NULL */
    int64_t q_stride;          /* elements between sequences in q, k_new and v_new */
    const void *k;             /* layer's K of block 0; V sits v_offset elements further */
    int64_t v_offset, block_stride;   /* elements */
    const int64_t *tables;     /* [num_seqs, width] */
    const int64_t *lens;       /* [num_seqs] */
    int64_t width, num_seqs, heads, dim, block_size;
    float scale;
    void *out;                 /* [num_seqs, heads, dim] contiguous, q's dtype */
    int64_t max_len, group;    /* group: heads per work item (divides heads) */
    int64_t next;              /* next (seq, head) pair, shared by the workers */
} Job;

/* GCC/Clang vector extensions: 8 float lanes (one AVX2 register under -march=native). */
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline f32x8 load_f32(const float *p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }

static inline f32x8 load_bf16(const uint16_t *p) {  /* exact: bf16 is float's top half */
    u16x8 h; memcpy(&h, p, sizeof h);
    u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    f32x8 v; memcpy(&v, &w, sizeof v); return v;
}

static inline void store_f32(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }

static inline void store_bf16(uint16_t *p, f32x8 v) {  /* round to nearest even, as torch */
    for (int j = 0; j < LANES; j++) {
        union { uint32_t u; float f; } c; c.f = v[j];
        p[j] = isnan(v[j]) ? 0x7fc0 : (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
    }
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

/* (sum8(a), sum8(b), sum8(c), sum8(d)), each added in sum8's order, in a few shuffles */
static inline f32x4 sum8x4(f32x8 a, f32x8 b, f32x8 c, f32x8 d) {
    f32x4 a4 = halves(a), b4 = halves(b), c4 = halves(c), d4 = halves(d);
    f32x4 ab = EVENS(a4, b4) + ODDS(a4, b4), cd = EVENS(c4, d4) + ODDS(c4, d4);
    return EVENS(ab, cd) + ODDS(ab, cd);
}

/* One work item = one sequence and a group of `group` adjacent heads, read token by token
   (each token's K/V of the group is one contiguous run): first this step's K/V of the
   group are written at position len - 1 (when k_new is set), then scores, softmax and the
   weighted sum of V; float32 throughout. Queries and output are QT (QLOAD, QSTORE), the
   cache T (LOAD, STORE). `scores` holds group * max_len floats, position-major (the score
   of position p and head h at p * group + h).
   The loads of K and V are what a decode step waits for: both
   passes stream rows in memory order and keep several independent chains in flight, so
   that the arithmetic hides under the loads. q.k takes four (token, head) pairs at a time,
   four dot products whose sums reduce together (`sum8x4`); p.v takes four tokens at a
   time, so that each accumulator is read and written once per four rows. Every sum is
   formed in the same order as one pair or one token at a time would form it. */
#define KERNEL(NAME, QT, QLOAD, QSTORE, T, LOAD, STORE)                                  \
static inline f32x8 NAME##_dot(const T *k, const f32x8 *q, int64_t vecs) {              \
    f32x8 dot = LOAD(k) * q[0];                                                         \
    for (int64_t i = 1; i < vecs; i++) dot += LOAD(k + i * LANES) * q[i];               \
    return dot;                                                                         \
}                                                                                       \
static void NAME(Job *job, float *scores) {                                             \
    const QT *q = job->q;                                                               \
    T *kbase = (T *)job->k;                                                             \
    const int64_t heads = job->heads, dim = job->dim, vecs = dim / LANES;               \
    const int64_t bs = job->block_size, row = heads * dim, g = job->group;              \
    const int64_t groups = heads / g;                                                   \
    f32x8 qv[g * vecs], acc[g * vecs];                                                  \
    float peak[g], total[g];                                                            \
    for (;;) {                                                                          \
        int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);            \
        if (item >= job->num_seqs * groups) return;                                     \
        int64_t seq = item / groups, h0 = item % groups * g, len = job->lens[seq];      \
        const int64_t *table = job->tables + seq * job->width;                          \
        const int64_t at = seq * job->q_stride + h0 * dim;                              \
        if (job->k_new != NULL) {                                                       \
            const int64_t p = len - 1;                                                  \
            T *kw = kbase + table[p / bs] * job->block_stride + p % bs * row + h0 * dim; \
            const QT *kn = (const QT *)job->k_new + at, *vn = (const QT *)job->v_new + at; \
            for (int64_t i = 0; i < g * vecs; i++) {                                    \
                STORE(kw + i * LANES, QLOAD(kn + i * LANES));                           \
                STORE(kw + job->v_offset + i * LANES, QLOAD(vn + i * LANES));           \
            }                                                                           \
        }                                                                               \
        for (int64_t i = 0; i < g * vecs; i++) qv[i] = QLOAD(q + at + i * LANES) * job->scale; \
        for (int64_t p0 = 0; p0 < len; p0 += bs) {                                      \
            const T *k = kbase + table[p0 / bs] * job->block_stride + h0 * dim;         \
            const int64_t pairs = (len - p0 < bs ? len - p0 : bs) * g;                  \
            float *s = scores + p0 * g;                                                 \
            int64_t j = 0, t = 0, h = 0;  /* pair j = (token t, head h) */              \
            for (; j + 4 <= pairs; j += 4) {                                            \
                f32x8 d[4];                                                             \
                for (int u = 0; u < 4; u++) {                                           \
                    d[u] = NAME##_dot(k + t * row + h * dim, qv + h * vecs, vecs);      \
                    if (++h == g) h = 0, t++;                                           \
                }                                                                       \
                const f32x4 four = sum8x4(d[0], d[1], d[2], d[3]);                      \
                memcpy(s + j, &four, sizeof four);                                      \
            }                                                                           \
            for (; j < pairs; j++) {                                                    \
                s[j] = sum8(NAME##_dot(k + t * row + h * dim, qv + h * vecs, vecs));    \
                if (++h == g) h = 0, t++;                                               \
            }                                                                           \
        }                                                                               \
        for (int64_t h = 0; h < g; h++) peak[h] = -INFINITY, total[h] = 0;              \
        for (int64_t p = 0; p < len; p++)                                               \
            for (int64_t h = 0; h < g; h++)                                             \
                if (scores[p * g + h] > peak[h]) peak[h] = scores[p * g + h];           \
        for (int64_t h = 0; h < g; h++)                                                 \
            for (int64_t p = 0; p < len; p++)                                           \
                total[h] += scores[p * g + h] = expf(scores[p * g + h] - peak[h]);      \
        for (int64_t i = 0; i < g * vecs; i++) acc[i] = (f32x8){0};                     \
        for (int64_t p0 = 0; p0 < len; p0 += bs) {                                      \
            const T *v = kbase + job->v_offset + table[p0 / bs] * job->block_stride     \
                         + h0 * dim;                                                    \
            const float *w = scores + p0 * g;                                           \
            const int64_t n = len - p0 < bs ? len - p0 : bs;                            \
            int64_t t = 0;                                                              \
            for (; t + 4 <= n; t += 4, v += 4 * row, w += 4 * g)                        \
                for (int64_t h = 0; h < g; h++) {                                       \
                    const float w0 = w[h], w1 = w[g + h], w2 = w[2 * g + h], w3 = w[3 * g + h]; \
                    for (int64_t i = 0; i < vecs; i++) {                                \
                        const T *vi = v + h * dim + i * LANES;                          \
                        f32x8 a = acc[h * vecs + i];                                    \
                        a += LOAD(vi) * w0;                                             \
                        a += LOAD(vi + row) * w1;                                       \
                        a += LOAD(vi + 2 * row) * w2;                                   \
                        a += LOAD(vi + 3 * row) * w3;                                   \
                        acc[h * vecs + i] = a;                                          \
                    }                                                                   \
                }                                                                       \
            for (; t < n; t++, v += row, w += g)                                        \
                for (int64_t h = 0; h < g; h++)                                         \
                    for (int64_t i = 0; i < vecs; i++)                                  \
                        acc[h * vecs + i] += LOAD(v + h * dim + i * LANES) * w[h];      \
        }                                                                               \
        QT *out = (QT *)job->out + (seq * heads + h0) * dim;                            \
        for (int64_t h = 0; h < g; h++)                                                 \
            for (int64_t i = 0; i < vecs; i++)                                          \
                QSTORE(out + (h * vecs + i) * LANES, acc[h * vecs + i] / total[h]);     \
    }                                                                                   \
}

KERNEL(decode_f32, float, load_f32, store_f32, float, load_f32, store_f32)
KERNEL(decode_bf16, uint16_t, load_bf16, store_bf16, uint16_t, load_bf16, store_bf16)
KERNEL(decode_f32_bf16, float, load_f32, store_f32, uint16_t, load_bf16, store_bf16)

enum { F32 = 0, BF16 = 1, F32_OVER_BF16 = 2 };  /* (queries, cache) dtypes */

typedef struct { Job *job; int kind; } Worker;

static void *work(void *arg) {
    Worker *w = arg;
    int64_t len = w->job->max_len > 0 ? w->job->max_len : 1;
    float *scores = malloc(sizeof(float) * w->job->group * len);
    if (scores == NULL) return (void *)1;
    if (w->kind == BF16) decode_bf16(w->job, scores);
    else if (w->kind == F32_OVER_BF16) decode_f32_bf16(w->job, scores);
    else decode_f32(w->job, scores);
    free(scores);
    return NULL;
}

/* Returns 0 on success, -1 when memory or threads ran out (the caller falls back; the
   K/V writes may then have happened, which the caller's own write repeats). */
int paged_decode(const void *q, const void *k_new, const void *v_new, int64_t q_stride,
                 const void *k, int64_t v_offset, int64_t block_stride,
                 const int64_t *tables, int64_t width, const int64_t *lens, int64_t num_seqs,
                 int64_t heads, int64_t dim, int64_t block_size, int64_t max_len, float scale,
                 void *out, int kind, int num_threads) {
    /* whole sequences when there are enough to share out, else one head per item */
    int64_t group = num_seqs >= 4 * num_threads ? heads : 1;
    Job job = {q, k_new, v_new, q_stride, k, v_offset, block_stride, tables, lens, width,
               num_seqs, heads, dim, block_size, scale, out, max_len, group, 0};
    Worker worker = {&job, kind};
    pthread_t threads[64];
    int started = 0, failed = 0;
    if (num_threads > 64) num_threads = 64;
    for (; started < num_threads - 1; started++)
        if (pthread_create(&threads[started], NULL, work, &worker) != 0) break;
    failed |= work(&worker) != NULL;
    for (int i = 0; i < started; i++) {
        void *status;
        pthread_join(threads[i], &status);
        failed |= status != NULL;
    }
    return failed ? -1 : 0;
}
"""


@cache
def _library() -> ctypes.CDLL | None:
    """Compiles (once per source and flags) and loads the kernel; None when it cannot."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return cpu_kernels.build("paged_decode", _SOURCE, [
        ptr, ptr, ptr, i64, ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, i64,
        ctypes.c_float, ptr, ctypes.c_int, ctypes.c_int])


def is_supported(kv_cache: Tensor) -> bool:
    """Whether `decode` runs for this cache (and the kernel builds on this machine)."""
    return (kv_cache.device.type == "cpu" and kv_cache.dtype in KERNEL_DTYPES
            and kv_cache.shape[-1] % LANES == 0 and kv_cache.is_contiguous()
            and _library() is not None)


# (queries, cache) dtypes -> the kernel's `kind`: same dtype, or float32 queries over a
# bf16 cache (models whose activations stay float32 between float32 matmuls)
_KINDS = {(torch.float32, torch.float32): 0, (torch.bfloat16, torch.bfloat16): 1,
          (torch.float32, torch.bfloat16): 2}


def _rows(t: Tensor) -> Tensor:
    """`t` (`[num_seqs, heads, dim]`) with contiguous heads; sequences may be strided."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def decode(q: Tensor, kv_cache: Tensor, layer: int, block_tables: Tensor, seq_lens: Tensor,
           max_seq_len: int, scale: float, new_kv: tuple[Tensor, Tensor] | None = None
           ) -> Tensor | None:
    """`[num_seqs, heads, dim]` attention (q's dtype) of one query per sequence over its
    first `seq_lens[i]` cached tokens of `layer` (blocks `block_tables[i]`). With `new_kv`
    (this step's `[num_seqs, heads, dim]` K and V, q's dtype), each sequence first writes
    them at its position `seq_lens[i] - 1`, rounded to the cache's dtype, as `write_kv`
    does. q, K and V may be views of one fused projection (rows strided alike). None when
    unsupported (`is_supported`, or a dtype pair the kernel lacks), so that the caller takes
    its reference path (and its own KV write)."""
    kind = _KINDS.get((q.dtype, kv_cache.dtype))
    if kind is None or not is_supported(kv_cache):
        return None
    lib = _library()
    assert lib is not None
    _, num_layers, _, block_size, num_heads, head_dim = kv_cache.shape
    q = _rows(q)  # [num_seqs, heads, dim]
    k_new = v_new = None
    if new_kv is not None:
        k_new, v_new = (_rows(t.to(q.dtype)) for t in new_kv)
        if not k_new.stride() == v_new.stride() == q.stride():
            q, k_new, v_new = q.contiguous(), k_new.contiguous(), v_new.contiguous()
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()  # long
    out = torch.empty(q.shape, dtype=q.dtype)  # [num_seqs, heads, dim]
    block_elems = block_size * num_heads * head_dim  # one K (or V) block of one layer
    k_ptr = kv_cache.data_ptr() + layer * 2 * block_elems * kv_cache.element_size()
    status = lib.paged_decode(
        q.data_ptr(), None if k_new is None else k_new.data_ptr(),
        None if v_new is None else v_new.data_ptr(), q.stride(0), k_ptr, block_elems,
        num_layers * 2 * block_elems, tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        q.shape[0], num_heads, head_dim, block_size, max_seq_len, scale, out.data_ptr(), kind,
        torch.get_num_threads())
    return out if status == 0 else None
