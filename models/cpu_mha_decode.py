"""Decode attention for multi-head bf16 models (one query head per KV head) on CPUs with
AVX-512 BF16, in C, compiled once on first use.

A decode step of such a model reads every cached K and V row once and does little
arithmetic on it, so its speed is how fast the cache streams in. This kernel makes one pass
over each sequence's positions, 16 at a time (a tile), with an online softmax: the K rows
of a tile give 16 scores per head (`vdpbf16ps` on each row, then one transposed sum of the
16 partial vectors), the running maximum and sum are updated, and the same tile's V rows
(widened exactly to float32, the weights kept float32) are added into the output. The K and
V of a block lie side by side in the cache, so a tile is one or two contiguous runs; while a
tile is read, the next one (or the first tile of the worker's next sequence) is prefetched
into L2 a slice per head, in memory order, so that the loads always have the next lines in
flight without a burst of prefetches stalling them.

Work items are whole sequences (single heads when the batch is small), handed out to
torch's OpenMP threads by a shared counter; each worker claims its next item before it
starts the current one, so that it knows what to prefetch. As in `models.cpu_attention`
this step's K/V are written first (given `new_kv`), and the output is rounded once.

Optional, as the other kernels: `decode` returns None where it cannot run (no AVX-512 BF16,
another dtype, grouped queries, a head_dim other than 32, 64, 96 or 128, no C compiler), and
`models.cpu_attention.decode` takes its own kernel.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import Tensor

from models import cpu_bf16_attention, cpu_kernels

HEAD_DIMS = (32, 64, 96, 128)  # head_dims with a kernel (32 bf16 per vector load)

_SOURCE = cpu_bf16_attention.HEADER + r"""
enum { TILE = 16 };  /* positions per tile: one score per lane */

typedef struct {
    const uint16_t *q;             /* [num_seqs, heads, dim], sequences q_stride apart */
    const uint16_t *k_new, *v_new;  /* this step's [num_seqs, heads, dim] K/V, or NULL */
    int64_t q_stride, k_stride, v_stride;
    uint16_t *k;                   /* the layer's K of block 0; V sits v_offset further */
    int64_t v_offset, block_stride;
    const int64_t *tables, *lens;  /* [num_seqs, width], [num_seqs] */
    int64_t width, heads, dim, block_size, group;  /* group: heads per work item */
    float scale;
    uint16_t *out;                 /* [num_seqs, heads, dim] contiguous */
} Job;

/* lane i: the sum of v[i]'s 16 lanes (pairs, then quads, then across 128-bit lanes) */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                    _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                    _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xdd));
}

/* The K row addresses (at the item's first head) of positions [p0, p0 + TILE) of sequence
   s; returns how many of them exist. */
static inline int tile_rows(const Job *job, int64_t s, int64_t h0, int64_t p0,
                            const uint16_t **rows) {
    const int64_t len = job->lens[s], bs = job->block_size, row = job->heads * job->dim;
    const int64_t *table = job->tables + s * job->width;
    const int n = len - p0 < TILE ? (int)(len - p0) : TILE;
    for (int t = 0; t < n; t++)
        rows[t] = job->k + h0 * job->dim + table[(p0 + t) / bs] * job->block_stride
                  + (p0 + t) % bs * row;
    return n;
}

/* Heads [h0, h0 + g) of sequence s; (ns, nh0): the worker's next item (ns < 0: none).
   CH: 32-element chunks per head (a constant where inlined). The accumulators hold each
   chunk as its even then its odd elements (the order a bf16 vector widens in cheaply); the
   output puts them back. */
static inline __attribute__((always_inline)) void item(
        const Job *job, float *accs, int64_t s, int64_t h0, int64_t ns, int64_t nh0,
        const int CH) {
    const int64_t dim = job->dim, g = job->group, len = job->lens[s], vo = job->v_offset;
    if (job->k_new != NULL) {
        const int64_t p = len - 1, at = job->tables[s * job->width + p / job->block_size]
            * job->block_stride + p % job->block_size * job->heads * dim + h0 * dim;
        memcpy(job->k + at, job->k_new + s * job->k_stride + h0 * dim, g * dim * 2);
        memcpy(job->k + vo + at, job->v_new + s * job->v_stride + h0 * dim, g * dim * 2);
    }
    const uint16_t *q = job->q + s * job->q_stride + h0 * dim;
    float peak[g], total[g];
    for (int64_t h = 0; h < g; h++) peak[h] = -INFINITY, total[h] = 0.0f;
    memset(accs, 0, g * dim * sizeof(float));
    const __m512 lane = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    const uint16_t *rows[TILE], *next[TILE];
    const int64_t row_lines = g * dim * 2 / 64;  /* cache lines of one position's K rows */
    int n = tile_rows(job, s, h0, 0, rows);
    for (int64_t p0 = 0; p0 < len; p0 += TILE) {
        const int nn = p0 + TILE < len ? tile_rows(job, s, h0, p0 + TILE, next)
                       : ns >= 0 ? tile_rows(job, ns, nh0, 0, next) : 0;
        for (int64_t h = 0; h < g; h++) {
            /* the next tile's K and V lines, this head's share of them in memory order */
            for (int64_t i = h * nn * row_lines / g; i < (h + 1) * nn * row_lines / g; i++) {
                const char *line = (const char *)next[i / row_lines] + i % row_lines * 64;
                _mm_prefetch(line, _MM_HINT_T1);
                _mm_prefetch(line + vo * 2, _MM_HINT_T1);
            }
            const int64_t off = h * dim;
            __m512bh qv[CH];
            for (int c = 0; c < CH; c++) qv[c] = (__m512bh)_mm512_loadu_si512(q + off + c * 32);
            __m512 d[TILE];
            for (int t = 0; t < TILE; t++) {
                d[t] = _mm512_setzero_ps();
                if (t < n)
                    for (int c = 0; c < CH; c++)
                        d[t] = _mm512_dpbf16_ps(d[t], qv[c], (__m512bh)_mm512_loadu_si512(
                            rows[t] + off + c * 32));
            }
            const __m512 scores = _mm512_mask_mul_ps(  /* positions past the tile: -inf */
                _mm512_set1_ps(-INFINITY), _mm512_cmp_ps_mask(lane, _mm512_set1_ps((float)n),
                _CMP_LT_OQ), sum16(d), _mm512_set1_ps(job->scale));
            const float top = _mm512_reduce_max_ps(scores), was = peak[h];
            const float now = top > was ? top : was, alpha = expf(was - now);
            const __m512 e = exp16(_mm512_sub_ps(scores, _mm512_set1_ps(now)));
            peak[h] = now, total[h] = total[h] * alpha + _mm512_reduce_add_ps(e);
            float w[TILE];
            _mm512_storeu_ps(w, e);
            float *acc = accs + off;
            __m512 a[2 * CH];
            for (int c = 0; c < 2 * CH; c++)
                a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), _mm512_set1_ps(alpha));
            for (int t = 0; t < n; t++) {
                const __m512 wt = _mm512_set1_ps(w[t]);
                for (int c = 0; c < CH; c++) {
                    const __m512i x = _mm512_loadu_si512(rows[t] + vo + off + c * 32);
                    a[2 * c] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
                                               wt, a[2 * c]);
                    a[2 * c + 1] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x, high)),
                                                   wt, a[2 * c + 1]);
                }
            }
            for (int c = 0; c < 2 * CH; c++) _mm512_storeu_ps(acc + c * 16, a[c]);
        }
        for (int t = 0; t < nn; t++) rows[t] = next[t];
        n = nn;
    }
    uint16_t *out = job->out + (s * job->heads + h0) * dim;
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int64_t h = 0; h < g; h++) {
        const __m512 inv = _mm512_set1_ps(1.0f / total[h]);
        for (int64_t c = 0; c < dim / 32; c++) {
            const float *acc = accs + h * dim + c * 32;
            const __m512 even = _mm512_loadu_ps(acc), odd = _mm512_loadu_ps(acc + 16);
            uint16_t *o = out + h * dim + c * 32;
            _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(_mm512_permutex2var_ps(even, first, odd), inv)));
            _mm256_storeu_si256((__m256i *)(o + 16), (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(_mm512_permutex2var_ps(even, second, odd), inv)));
        }
    }
}

static void run_item(const Job *job, float *accs, int64_t s, int64_t h0, int64_t ns,
                     int64_t nh0) {
    switch (job->dim) {
        case 32: item(job, accs, s, h0, ns, nh0, 1); break;
        case 64: item(job, accs, s, h0, ns, nh0, 2); break;
        case 96: item(job, accs, s, h0, ns, nh0, 3); break;
        default: item(job, accs, s, h0, ns, nh0, 4); break;  /* 128 */
    }
}

/* Returns 0, or -1 when scratch memory ran out (the caller falls back; the K/V writes may
   then have happened, which the caller's own write repeats). */
int paged_decode_mha(const uint16_t *q, const uint16_t *k_new, const uint16_t *v_new,
                     int64_t q_stride, int64_t k_stride, int64_t v_stride, uint16_t *k,
                     int64_t v_offset, int64_t block_stride, const int64_t *tables,
                     int64_t width, const int64_t *lens, int64_t num_seqs, int64_t heads,
                     int64_t rep, int64_t dim, int64_t block_size, int64_t max_len,
                     float scale, uint16_t *out, int num_threads) {
    (void)rep, (void)max_len;  /* one query head per KV head; no scores kept */
    const int threads = num_threads > 0 ? num_threads : 1;
    /* whole sequences when there are enough to share out, else one head per item */
    const int64_t g = num_seqs >= 4 * threads ? heads : 1, items = num_seqs * (heads / g);
    Job job = {q, k_new, v_new, q_stride, k_stride, v_stride, k, v_offset, block_stride,
               tables, lens, width, heads, dim, block_size, g, scale, out};
    int64_t counter = 0;
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(|: failed)
    {
        float *accs = malloc(sizeof(float) * g * dim);
        failed = accs == NULL;
        int64_t i = failed ? items : __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED);
        while (i < items) {
            const int64_t next = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED);
            const int64_t ns = next < items ? next / (heads / g) : -1;
            run_item(&job, accs, i / (heads / g), i % (heads / g) * g, ns,
                     next % (heads / g) * g);
            i = next;
        }
        free(accs);
    }
    return failed ? -1 : 0;
}
"""


@cache
def _library() -> ctypes.CDLL | None:
    """Compiles (once per source and flags) and loads the kernel; None when it cannot."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64,
                i64, i64, ctypes.c_float, ptr, ctypes.c_int]
    # NOTE: `paged_decode_bf16`'s arguments (`cpu_bf16_attention.run_paged_decode`)
    return cpu_kernels.build_openmp("paged_decode_mha", _SOURCE, argtypes)


def decode(q: Tensor, kv_cache: Tensor, layer: int, block_tables: Tensor, seq_lens: Tensor,
           max_seq_len: int, scale: float, new_kv: tuple[Tensor, Tensor] | None = None
           ) -> Tensor | None:
    """`models.cpu_attention.decode` for bf16 queries with one head per KV head of a bf16
    cache (same arguments and result); None where it cannot run (see the module's
    docstring)."""
    kv_heads, head_dim = kv_cache.shape[4:]
    if (q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16 or q.device.type != "cpu"
            or q.shape[1] != kv_heads or head_dim not in HEAD_DIMS
            or not kv_cache.is_contiguous() or not cpu_bf16_attention.is_supported(q)):
        return None
    lib = _library()
    return None if lib is None else cpu_bf16_attention.run_paged_decode(
        lib.paged_decode_mha, q, kv_cache, layer, block_tables, seq_lens, max_seq_len, scale,
        new_kv)
