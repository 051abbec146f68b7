"""Attention kernels in bf16 for CPUs with AVX-512 BF16, in C, compiled once on first use.

torch's CPU flash attention runs its bf16 tiles through small GEMM calls and reaches a
fraction of the rate of the CPU's bf16 dot-product instruction (`vdpbf16ps`: 32 bf16
products summed into 16 floats per instruction). This kernel is a flash attention built on
that instruction: each (sequence, KV head) has its K packed once as pairs of dimensions for
16 keys at a time and its V as pairs of keys for 16 dimensions at a time, so that both
`Q K^T` and `P V` run as register-blocked `vdpbf16ps` loops (6 queries x 64 keys, or 6
queries x 64 dimensions, in 24 accumulators). Scores, the running softmax and the output
stay float32; the weights are rounded to bf16 for `P V` and the output once, as torch's
bf16 flash attention does.

Every prompt sequence of a step goes to one call: work items are (sequence, KV head, block
of query rows, 96 query vectors in all) with all the query heads that share the KV head
(grouped-query attention reads each K/V tile once for all of them), handed out to torch's
own OpenMP threads longest first. A sequence may have a cached prefix (chunked prefill):
its queries then sit at the end of its keys (bottom-right causal mask).

`decode` is the same for one query per sequence over its paged KV, for grouped-query
models (`models.cpu_attention.decode` hands it those): q.k by `vdpbf16ps` on each K row,
p.v by `vdpbf16ps` over pairs of V rows, each row read once for all the query heads that
share it, the next block prefetched into L2 (with a whole sequence per work item, its K and
the current block's V a line per q.k product, so that the misses overlap with the
products). On a CPU with AMX (and blocks of whole 16-key tiles) q.k is a tile product
instead: 16 K rows, loaded straight from the cache, times the query heads of their KV
head packed once per sequence as the second operand, 16 x rep scores per product where
the vector path sums 16 lanes per score; at head_dim 64 p.v is one too, a KV head at a
time: the bf16 weights of its query heads (16 keys) times its V rows of 16 keys
interleaved in pairs (the second operand's layout, built per tile), into four
accumulator tiles that stay put over the whole sequence.

With AMX, torch's flash attention hands its tiles to oneDNN, whose GEMMs run on the AMX
tile units, and computes prompts of 128 tokens and more 1.7-2.4x faster than the
`vdpbf16ps` loops (docs/results-cpu.md). There `prefill` runs both products on the tiles
too, 16 query vectors at a time: the packed K (dimension pairs x 16 keys) and the packed V
(key pairs x 16 dimensions) are already the layout of the tile product's second operand,
the queries and the bf16 weights its first; the softmax stays in vector registers.

Optional, as torch's `scaled_dot_product_attention` stays the reference: each returns
None where its kernel cannot run (no AVX-512 BF16, another dtype or device, a head_dim not a
multiple of 32, no C compiler), and the caller keeps its torch path. Built and cached by
`models.cpu_kernels` (ASERVE_CPU_KERNELS=0 disables it).
"""

from __future__ import annotations

import ctypes
import itertools
import os
from collections.abc import Callable
from functools import cache

import torch
from torch import Tensor

from models import cpu_isa, cpu_kernels

# where `prefill` beats torch's SDPA (module docstring): on AMX with its tiles only
PROMPT_LEVELS = ("AVX-512-bf16", "AMX")
# AMX tiles where the CPU has them: prompts' q.k and p.v, decode's q.k (False, or
# ASERVE_CPU_TILES=0: `vdpbf16ps` for decode and torch's SDPA for prompts)
TILES = os.environ.get("ASERVE_CPU_TILES", "1") != "0"

# C shared with the other AVX-512 BF16 kernels (`models.cpu_mha_decode`)
HEADER = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp of 16 floats (Cephes' polynomial after r = x - k ln 2), about one ulp of expf;
   inputs below -87.3 (masked scores: -inf) give 0 */
static inline __m512 exp16(__m512 x) {
    const __mmask16 some = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_GE_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.37626f)), _mm512_set1_ps(-87.33654f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k),
                                                   _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(some, p, _mm512_castsi512_ps(e));
}
"""

# C shared with the other kernels on AMX tiles (`models.cpu_bf16_gemm`): after HEADER, it
# defines HAS_AMX where the compiler targets AMX-BF16
AMX_HEADER = r"""
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAS_AMX 1

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Whether this process may use the tile registers: Linux has each process ask once
   (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA). */
static int amx_allowed(void) {
    static int allowed = -1;
    if (allowed < 0)
        allowed = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return allowed;
}

/* This thread's tiles 0 .. n - 1: rows[t] rows (16 where rows is NULL) of colsb[t] bytes
   (16 floats, or 32 bf16 as 16 pairs, at most) */
static void amx_configure_rows(int n, const uint16_t *colsb, const uint8_t *rows) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < n; t++) cfg.rows[t] = rows ? rows[t] : 16, cfg.colsb[t] = colsb[t];
    _tile_loadconfig(&cfg);
}

static void amx_configure(int n, const uint16_t *colsb) { amx_configure_rows(n, colsb, NULL); }
#endif
"""

_SOURCE = HEADER + AMX_HEADER + r"""

enum { BK = 64, MB = 6 };  /* keys per tile, queries per pass */

/* exp of 16 floats <= 0 for weights that are rounded to bf16: 2^(x log2 e) as a degree-4
   polynomial of the fraction (relative error about 5e-5, far below bf16's 4e-3) scaled by
   the integer part; inputs below -87 (masked scores: -inf) give 0, not a denormal (whose
   arithmetic is slow) */
static inline __m512 exp16_weights(__m512 x) {
    const __mmask16 some = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)),
                                   _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.6181291e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(some, p, n);
}

#ifdef HAS_AMX
/* scores[m][0, BK) = q[m] . K[tile keys] for 16 queries (dim bf16 each, contiguous) on the
   tiles: the packed K's groups of 16 keys are tile B as they lie (dimension pairs x keys) */
static void scores_tiles(const uint16_t *q, int64_t dim, const uint32_t *kt, float *scores) {
    const int64_t words = dim / 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < dim / 32; c++) {
        _tile_loadd(4, q + c * 32, dim * 2);
        _tile_loadd(5, kt + (0 * words + c * 16) * 16, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, kt + (1 * words + c * 16) * 16, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, kt + (2 * words + c * 16) * 16, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, kt + (3 * words + c * 16) * 16, 64);
        _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, scores, BK * 4);
    _tile_stored(1, scores + 16, BK * 4);
    _tile_stored(2, scores + 32, BK * 4);
    _tile_stored(3, scores + 48, BK * 4);
}

/* o[m] = alpha[m] o[m] + the p[m] weights (BK bf16) . V[tile keys] for 16 queries: the
   product on the tiles (the packed V, key pairs x dimensions, is tile B as it lies) into
   pv, then the rescale and the sum in one vector pass over o */
static void values_tiles(const uint32_t *p, const float *alpha, const uint16_t *vt,
                         int64_t dim, float *o) {
    float pv[16 * dim];
    _tile_loadd(4, p, BK * 2);            /* keys [0, 32) */
    _tile_loadd(5, p + 16, BK * 2);       /* keys [32, 64) */
    for (int64_t d = 0; d < dim; d += 16) {
        _tile_zero(0);
        _tile_loadd(6, vt + 2 * d, dim * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, vt + 16 * 2 * dim + 2 * d, dim * 4);
        _tile_dpbf16ps(0, 5, 7);
        _tile_stored(0, pv + d, dim * 4);
    }
    for (int64_t m = 0; m < 16; m++) {
        const __m512 a = _mm512_set1_ps(alpha[m]);
        for (int64_t d = 0; d < dim; d += 16)
            _mm512_storeu_ps(o + m * dim + d, _mm512_fmadd_ps(a, _mm512_loadu_ps(o + m * dim + d),
                                                              _mm512_loadu_ps(pv + m * dim + d)));
    }
}
#endif

typedef struct {
    const uint16_t *q;          /* [tokens, heads * rep, dim] rows q_row apart */
    int64_t q_row;
    const int64_t *q_start, *q_len, *s_len;  /* per sequence: first row, queries, keys */
    const int64_t *k, *v;       /* per sequence: address of its K / V row 0 (bf16) */
    const int64_t *k_row, *v_row;  /* per sequence: elements between its K / V rows */
    int64_t num_seqs, heads, rep, dim;  /* heads: KV heads */
    int64_t rows;               /* query rows per work item */
    float scale;
    uint16_t *out;              /* [tokens, heads * rep, dim] contiguous */
    uint16_t *packed;           /* per (sequence, KV head): K then V, tiles of BK keys */
    const int64_t *packed_at;   /* per sequence: offset of its head 0 in packed */
    int tiles;                  /* both products on the AMX tiles, 16 queries at a time */
} Job;

static inline int64_t tiles_of(int64_t n) { return (n + BK - 1) / BK; }

/* K of keys [0, n) as 32-bit words: tile t, dimension pair j, key lane l (16 keys per
   group, BK / 16 groups per tile) holds (K[key][2j], K[key][2j + 1]); V as key pairs: word
   (pair kk, dimension d) holds (V[2kk][d], V[2kk + 1][d]), 16 dimensions per vector. Keys
   past n are zeros. */
static void pack(const Job *job, int64_t s, int64_t h) {
    const int64_t n = job->s_len[s], dim = job->dim, words = dim / 2, pad = tiles_of(n) * BK;
    uint32_t *kp = (uint32_t *)(job->packed + job->packed_at[s] + h * 2 * pad * dim);
    uint16_t *vp = job->packed + job->packed_at[s] + h * 2 * pad * dim + pad * dim;
    const uint16_t *k = (const uint16_t *)job->k[s] + h * dim;
    const uint16_t *v = (const uint16_t *)job->v[s] + h * dim;
    for (int64_t key = 0; key < pad; key++) {
        const int64_t t = key / BK, g = key % BK / 16, l = key % 16;
        uint32_t *dst = kp + (t * (BK / 16) + g) * words * 16 + l;
        if (key < n) {
            const uint32_t *src = (const uint32_t *)(k + key * job->k_row[s]);
            for (int64_t j = 0; j < words; j++) dst[j * 16] = src[j];
        } else {
            for (int64_t j = 0; j < words; j++) dst[j * 16] = 0;
        }
    }
    for (int64_t kk = 0; kk < pad / 2; kk++) {
        const uint16_t *v0 = v + 2 * kk * job->v_row[s], *v1 = v0 + job->v_row[s];
        const int have0 = 2 * kk < n, have1 = 2 * kk + 1 < n;
        uint16_t *dst = vp + kk * 2 * dim;
        for (int64_t d = 0; d < dim; d++) {
            dst[2 * d] = have0 ? v0[d] : 0;
            dst[2 * d + 1] = have1 ? v1[d] : 0;
        }
    }
}

static inline __m512bh bcast(const uint32_t *p) { return (__m512bh)_mm512_set1_epi32((int)*p); }

/* scores[m][0, BK) = q[m] . K[tile keys] for MB queries (words: dim / 2 pairs each) */
static inline void scores_tile(const uint32_t *q, int64_t words, const uint32_t *kt,
                               float *scores) {
    __m512 acc[MB][4];
    for (int m = 0; m < MB; m++)
        for (int g = 0; g < 4; g++) acc[m][g] = _mm512_setzero_ps();
    for (int64_t j = 0; j < words; j++) {
        __m512bh k[4];
        for (int g = 0; g < 4; g++)
            k[g] = (__m512bh)_mm512_loadu_si512(kt + (g * words + j) * 16);
        for (int m = 0; m < MB; m++) {
            __m512bh a = bcast(q + m * words + j);
            for (int g = 0; g < 4; g++) acc[m][g] = _mm512_dpbf16_ps(acc[m][g], a, k[g]);
        }
    }
    for (int m = 0; m < MB; m++)
        for (int g = 0; g < 4; g++) _mm512_storeu_ps(scores + m * BK + g * 16, acc[m][g]);
}

/* o[m][c0 * 16, (c0 + nc) * 16) = alpha[m] o[m] + the p[m] pairs . V pairs, MB queries;
   nc (4, or 2 at the end of a head_dim that is an odd multiple of 32) a constant when
   inlined */
static inline __attribute__((always_inline)) void values_tile(
        const uint32_t *p, const float *alpha, const uint16_t *vt, int64_t dim, int64_t c0,
        int nc, float *o) {
    __m512 acc[MB][4];
    for (int m = 0; m < MB; m++)
        for (int c = 0; c < nc; c++)
            acc[m][c] = _mm512_mul_ps(_mm512_loadu_ps(o + m * dim + (c0 + c) * 16),
                                      _mm512_set1_ps(alpha[m]));
    for (int64_t kk = 0; kk < BK / 2; kk++) {
        __m512bh v[4];
        for (int c = 0; c < nc; c++)
            v[c] = (__m512bh)_mm512_loadu_si512(vt + kk * 2 * dim + (c0 + c) * 32);
        for (int m = 0; m < MB; m++) {
            __m512bh a = bcast(p + m * (BK / 2) + kk);
            for (int c = 0; c < nc; c++) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], a, v[c]);
        }
    }
    for (int m = 0; m < MB; m++)
        for (int c = 0; c < nc; c++) _mm512_storeu_ps(o + m * dim + (c0 + c) * 16, acc[m][c]);
}

/* scores: two halves of padded x BK (this key tile's and the next's) */
typedef struct { float *scores, *o, *peak, *total, *top, *alpha; uint32_t *q, *p; } Scratch;

/* One work item: KV head h of sequence s, query rows [r0, r0 + job->rows) with their rep heads
   (query vector m = row * rep + i is head h * rep + i). */
static void item(const Job *job, Scratch *w, int64_t s, int64_t h, int64_t r0) {
    const int64_t dim = job->dim, words = dim / 2, rep = job->rep, n = job->s_len[s];
    const int64_t rows = job->q_len[s] - r0 < job->rows ? job->q_len[s] - r0 : job->rows;
    const int64_t unit = job->tiles ? 16 : MB;  /* queries per pass */
    const int64_t count = rows * rep, padded = (count + unit - 1) / unit * unit;
    const int64_t first = n - job->q_len[s] + r0;  /* position of row r0 */
    const int64_t keys = first + rows, pad = tiles_of(n) * BK;
    const uint16_t *kp = job->packed + job->packed_at[s] + h * 2 * pad * dim;
    const uint16_t *vp = kp + pad * dim;
    for (int64_t m = 0; m < padded; m++) {
        uint32_t *dst = w->q + m * words;
        if (m < count) {
            const uint16_t *src = job->q + (job->q_start[s] + r0 + m / rep) * job->q_row
                                  + (h * rep + m % rep) * dim;
            memcpy(dst, src, dim * sizeof(uint16_t));
        } else {
            memset(dst, 0, dim * sizeof(uint16_t));
        }
        w->peak[m] = -INFINITY, w->total[m] = 0.0f, w->alpha[m] = 1.0f;
    }
    memset(w->o, 0, padded * dim * sizeof(float));
    const __m512 scale = _mm512_set1_ps(job->scale), lane = _mm512_set_ps(
        15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t t = 0; t * BK < keys; t++) {
        const uint32_t *kt = (const uint32_t *)(kp + t * BK * dim);
        float *const sc = w->scores + (t & 1) * padded * BK;
#ifdef HAS_AMX
        /* the tile unit computes the next tile's scores (into the other half of scores)
           while the vector units run this tile's softmax */
        if (job->tiles)
            for (int64_t u = t == 0 ? 0 : t + 1; u <= t + 1 && u * BK < keys; u++)
                for (int64_t m = 0; m < padded; m += 16)
                    scores_tiles((const uint16_t *)(w->q + m * words), dim,
                                 (const uint32_t *)(kp + u * BK * dim),
                                 w->scores + ((u & 1) * padded + m) * BK);
        else
#endif
        for (int64_t m = 0; m < padded; m += MB)
            scores_tile(w->q + m * words, words, kt, sc + m * BK);
        /* every key of the tile at or before every query's position: nothing to mask */
        const int whole = (t + 1) * BK <= first + 1;
        for (int64_t m = 0; m < count; m++) {  /* scores masked; their scaled maximum */
            float *row = sc + m * BK;
            const __m512 last = _mm512_set1_ps((float)(first + m / rep - t * BK));
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int g = 0; g < 4; g++) {
                __m512 x = _mm512_loadu_ps(row + g * 16);
                if (!whole) {  /* keys after this query's position (and past n) */
                    x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmp_ps_mask(
                        _mm512_add_ps(lane, _mm512_set1_ps(16.0f * g)), last, _CMP_LE_OQ), x);
                    _mm512_storeu_ps(row + g * 16, x);
                }
                top = _mm512_max_ps(top, x);
            }
            w->top[m] = _mm512_reduce_max_ps(top) * job->scale;  /* scale > 0 */
        }
        for (int64_t m = 0; m < count; m += 16) {  /* running maxima and rescale factors */
            const __mmask16 live = count - m >= 16 ? 0xffff : (1u << (count - m)) - 1;
            const __m512 old = _mm512_maskz_loadu_ps(live, w->peak + m);
            const __m512 peak = _mm512_max_ps(old, _mm512_maskz_loadu_ps(live, w->top + m));
            _mm512_mask_storeu_ps(w->alpha + m, live, exp16(_mm512_sub_ps(old, peak)));
            _mm512_mask_storeu_ps(w->peak + m, live, peak);
        }
        for (int64_t m = 0; m < count; m++) {  /* weights, as bf16 key pairs; their sum */
            const float *row = sc + m * BK;
            const __m512 peak = _mm512_set1_ps(w->peak[m]);
            uint32_t *p = w->p + m * (BK / 2);
            __m512 sum = _mm512_setzero_ps();
            for (int g = 0; g < 4; g++) {
                const __m512 e = exp16_weights(_mm512_fmsub_ps(_mm512_loadu_ps(row + g * 16),
                                                               scale, peak));
                sum = _mm512_add_ps(sum, e);
                _mm256_storeu_si256((__m256i *)(p + g * 8), (__m256i)_mm512_cvtneps_pbh(e));
            }
            w->total[m] = w->total[m] * w->alpha[m] + _mm512_reduce_add_ps(sum);
        }
        for (int64_t m = count; m < padded; m++) memset(w->p + m * (BK / 2), 0, BK * 2);
        const uint16_t *vt = vp + t * BK * dim;
#ifdef HAS_AMX
        if (job->tiles) {
            for (int64_t m = 0; m < padded; m += 16)
                values_tiles(w->p + m * (BK / 2), w->alpha + m, vt, dim, w->o + m * dim);
            continue;
        }
#endif
        for (int64_t m = 0; m < padded; m += MB)
            for (int64_t c0 = 0; c0 < dim / 16; c0 += 4) {
                const uint32_t *p = w->p + m * (BK / 2);
                float *o = w->o + m * dim;
                if (dim / 16 - c0 >= 4) values_tile(p, w->alpha + m, vt, dim, c0, 4, o);
                else values_tile(p, w->alpha + m, vt, dim, c0, 2, o);
            }
    }
    const int64_t heads = job->heads * rep;
    for (int64_t m = 0; m < count; m++) {
        uint16_t *dst = job->out + ((job->q_start[s] + r0 + m / rep) * heads + h * rep
                                    + m % rep) * dim;
        const __m512 inv = _mm512_set1_ps(1.0f / w->total[m]);
        for (int64_t d = 0; d < dim; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(_mm512_loadu_ps(w->o + m * dim + d), inv)));
    }
}

/* Returns 0, or -1 when scratch memory ran out (the caller falls back). */
int prefill_attention(const uint16_t *q, int64_t q_row, const int64_t *q_start,
                      const int64_t *q_len, const int64_t *s_len, const int64_t *k,
                      const int64_t *v, const int64_t *k_row, const int64_t *v_row,
                      int64_t num_seqs, int64_t heads, int64_t rep, int64_t dim, int64_t rows,
                      float scale,
                      uint16_t *out, uint16_t *packed, const int64_t *packed_at,
                      const int64_t *items, int64_t num_items, int num_threads,
                      int use_tiles) {
    int tiles = 0;
#ifdef HAS_AMX
    tiles = use_tiles && amx_allowed();
#endif
    Job job = {q, q_row, q_start, q_len, s_len, k, v, k_row, v_row, num_seqs, heads, rep, dim,
               rows, scale, out, packed, packed_at, tiles};
    const int64_t most16 = (rows * rep + 15) / 16 * 16, most6 = (rows * rep + MB - 1) / MB * MB;
    const int64_t most = most16 > most6 ? most16 : most6;  /* either pass's padding */
    int failed = 0;
    #pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(|: failed)
    {
#ifdef HAS_AMX
        if (tiles)  /* all eight tiles of 16 rows x 64 bytes */
            amx_configure(8, (const uint16_t[8]){64, 64, 64, 64, 64, 64, 64, 64});
#endif
        #pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < num_seqs * heads; i++) pack(&job, i / heads, i % heads);
        Scratch w = {malloc(2 * most * BK * sizeof(float)), malloc(most * dim * sizeof(float)),
                     malloc(most * sizeof(float)), malloc(most * sizeof(float)),
                     malloc(most * sizeof(float)), malloc(most * sizeof(float)),
                     malloc(most * dim * sizeof(uint16_t)), malloc(most * BK * 2)};
        int ok = w.scores && w.o && w.peak && w.total && w.top && w.alpha && w.q && w.p;
        failed = !ok;
        /* items: (sequence, KV head, first row), longest first */
        #pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < num_items; i++)
            if (ok) item(&job, &w, items[3 * i], items[3 * i + 1], items[3 * i + 2]);
#ifdef HAS_AMX
        if (tiles)
            _tile_release();
#endif
        free(w.scores), free(w.o), free(w.peak), free(w.total), free(w.top), free(w.alpha);
        free(w.q), free(w.p);
    }
    return failed ? -1 : 0;
}

/* ---- decode: one query per sequence over its paged KV ---- */

typedef struct {
    const uint16_t *q;            /* [num_seqs, heads * rep, dim], sequences q_stride apart */
    const uint16_t *k_new, *v_new;  /* this step's [num_seqs, heads, dim] K/V, or NULL */
    int64_t q_stride, k_stride, v_stride;
    uint16_t *k;                  /* the layer's K of block 0; V sits v_offset further */
    int64_t v_offset, block_stride;
    const int64_t *tables, *lens;  /* [num_seqs, width], [num_seqs] */
    int64_t width, num_seqs, heads, rep, dim, block_size;
    float scale;
    uint16_t *out;                /* [num_seqs, heads * rep, dim] contiguous */
} Decode;

static inline void prefetch_rows(const uint16_t *p, int64_t n, int64_t row, int64_t bytes) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t b = 0; b < bytes; b += 64)
            __builtin_prefetch((const char *)(p + t * row) + b, 0, 2);
}

/* acc[r] (32 floats each, heads `stride` floats apart) += the weights of NR query heads
   (bf16 pairs: word i of w + r * wstride holds positions 2i, 2i + 1) times V rows
   [0, n) (32 dimensions, rows `row` apart), by vdpbf16ps over pairs of rows. The rows of
   a pair are interleaved 16 bits at a time per 128-bit lane, so acc holds dimensions in
   the order: of each 8, the first 4 in the first 16 floats, the last 4 in the second
   (the caller restores the order); a missing partner row (odd n) is zeros. */
static inline __attribute__((always_inline)) void pv_block(
        const uint16_t *v, int64_t row, int64_t n, const uint32_t *w, int64_t wstride,
        float *acc, int64_t stride, int NR) {
    __m512 lo[4], hi[4];
    for (int r = 0; r < NR; r++)
        lo[r] = _mm512_loadu_ps(acc + r * stride), hi[r] = _mm512_loadu_ps(acc + r * stride + 16);
    for (int64_t t = 0; t < n; t += 2) {
        const __m512i a = _mm512_loadu_si512(v + t * row);
        const __m512i b = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * row)
                                    : _mm512_setzero_si512();
        const __m512bh x = (__m512bh)_mm512_unpacklo_epi16(a, b);
        const __m512bh y = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int r = 0; r < NR; r++) {
            const __m512bh p = bcast(w + r * wstride + t / 2);
            lo[r] = _mm512_dpbf16_ps(lo[r], p, x), hi[r] = _mm512_dpbf16_ps(hi[r], p, y);
        }
    }
    for (int r = 0; r < NR; r++)
        _mm512_storeu_ps(acc + r * stride, lo[r]), _mm512_storeu_ps(acc + r * stride + 16, hi[r]);
}

#ifdef HAS_AMX
/* qb: the rep queries of each of g KV heads as tile B per 32 dimensions: word i of query
   r (dimensions 2i, 2i + 1 of the chunk) at [(h * chunks + c) * 16 + i] * rep + r. */
static void amx_pack_queries(const uint16_t *q, int64_t g, int64_t rep, int64_t dim,
                             uint32_t *qb) {
    const int64_t chunks = dim / 32;
    for (int64_t h = 0; h < g; h++)
        for (int64_t r = 0; r < rep; r++) {
            const uint32_t *qr = (const uint32_t *)(q + (h * rep + r) * dim);
            for (int64_t c = 0; c < chunks; c++)
                for (int64_t i = 0; i < 16; i++)
                    qb[((h * chunks + c) * 16 + i) * rep + r] = qr[c * 16 + i];
        }
}

/* Scores of n (at most 16) keys from K rows k (`row` apart, KV head h at h * dim) for the
   rep query heads of each of g KV heads, scaled, into scores (query head j at j * len,
   these keys at p0): one tile product per 32 dimensions. The tile loads 16 rows whatever
   n is: the caller's block holds them. */
static inline void amx_scores(const uint16_t *k, int64_t row, int64_t n, const uint32_t *qb,
                              int64_t g, int64_t rep, int64_t dim, float scale,
                              float *scores, int64_t len, int64_t p0, float *tile) {
    const int64_t chunks = dim / 32;
    const __mmask16 live = n >= 16 ? 0xffff : (1u << n) - 1;
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)rep));
    for (int64_t h = 0; h < g; h++) {
        _tile_zero(0);
        for (int64_t c = 0; c < chunks; c++) {
            _tile_loadd(1, k + h * dim + c * 32, row * 2);
            _tile_loadd(2, qb + (h * chunks + c) * 16 * rep, rep * 4);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, tile, rep * 4);
        for (int64_t r = 0; r < rep; r++) {
            const __m512 x = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, rows,
                                                      tile + r, 4);
            _mm512_mask_storeu_ps(scores + (h * rep + r) * len + p0, live,
                                  _mm512_mul_ps(x, _mm512_set1_ps(scale)));
        }
    }
}

/* the first rep rows of a stored 16 x 16 float tile into acc's rows (64 floats apart) */
static inline void tile_rows_to(const float *tile, int64_t rep, float *acc) {
    for (int64_t r = 0; r < rep; r++) memcpy(acc + r * 64, tile + r * 16, 16 * sizeof(float));
}

/* acc (the rep query heads of KV head h, `dim` = 64 floats each, in `pv_block`'s order) =
   their bf16 weights (w: head h's first query row, rows `wlen` apart, zero from len up to
   a whole tile of keys) times KV head h's V rows (vh, rows `row` apart, blocks as `table`
   says) over positions [0, len). Tiles 1, 3, 4, 5 accumulate dimensions 0-31 and 32-63,
   each as `pv_block`'s two halves; tile 6 holds 16 keys' weights of 16 query rows (rows
   past rep belong to the next head and go unused); tile 7 holds V rows of two keys
   interleaved per pair, built in vt (4 x 8 rows of 32 bf16), zeros past len. */
static void amx_values(const uint16_t *vh, const int64_t *table, int64_t block_stride,
                       int64_t bs, int64_t row, int64_t rep, int64_t len, const uint16_t *w,
                       int64_t wlen, uint16_t *vt, float *tile, float *acc) {
    _tile_zero(1);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t p0 = 0; p0 < len; p0 += 16) {
        const uint16_t *v = vh + table[p0 / bs] * block_stride + p0 % bs * row;
        if (p0 % bs == 0 && p0 + bs < len)
            prefetch_rows(vh + table[p0 / bs + 1] * block_stride, bs, row, 128);
        const int64_t n = len - p0 < 16 ? len - p0 : 16;
        for (int64_t i = 0; i < 8; i++)
            for (int64_t c = 0; c < 2; c++) {
                const __m512i a = 2 * i < n ? _mm512_loadu_si512(v + 2 * i * row + c * 32)
                                            : zero;
                const __m512i b = 2 * i + 1 < n
                    ? _mm512_loadu_si512(v + (2 * i + 1) * row + c * 32) : zero;
                _mm512_store_si512(vt + (2 * c * 8 + i) * 32, _mm512_unpacklo_epi16(a, b));
                _mm512_store_si512(vt + ((2 * c + 1) * 8 + i) * 32,
                                   _mm512_unpackhi_epi16(a, b));
            }
        _tile_loadd(6, w + p0, wlen * 2);
        _tile_loadd(7, vt, 64);
        _tile_dpbf16ps(1, 6, 7);
        _tile_loadd(7, vt + 256, 64);
        _tile_dpbf16ps(3, 6, 7);
        _tile_loadd(7, vt + 512, 64);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(7, vt + 768, 64);
        _tile_dpbf16ps(5, 6, 7);
    }
    _tile_stored(1, tile, 64);
    tile_rows_to(tile, rep, acc);
    _tile_stored(3, tile, 64);
    tile_rows_to(tile, rep, acc + 16);
    _tile_stored(4, tile, 64);
    tile_rows_to(tile, rep, acc + 32);
    _tile_stored(5, tile, 64);
    tile_rows_to(tile, rep, acc + 48);
}
#endif

/* KV heads [h0, h0 + g) of sequence s with their rep query heads each: scores over all
   positions (q.k by vdpbf16ps, one 16-lane sum per (token, query head)), softmax, then p.v
   in float32 from widened V rows. Both passes walk the block table in order, each block's
   rows of the g heads one contiguous run, the next block prefetched. */
static void decode_item(const Decode *job, float *scores, uint16_t *weights, float *acc,
                        uint32_t *qb, uint16_t *vt, float *tile, int64_t s, int64_t h0,
                        int64_t g) {
    const int64_t rep = job->rep, dim = job->dim, row = job->heads * dim, bs = job->block_size;
    const int64_t len = job->lens[s], chunks = dim / 32, vecs = dim / 16, gq = g * rep;
    const int64_t *table = job->tables + s * job->width, wlen = (len + 16) / 16 * 16;
    uint16_t *const k0 = job->k + h0 * dim, *const v0 = k0 + job->v_offset;
    if (job->k_new != NULL) {
        const int64_t p = len - 1, at = table[p / bs] * job->block_stride + p % bs * row;
        memcpy(k0 + at, job->k_new + s * job->k_stride + h0 * dim, g * dim * sizeof(uint16_t));
        memcpy(v0 + at, job->v_new + s * job->v_stride + h0 * dim, g * dim * sizeof(uint16_t));
    }
    const uint16_t *q = job->q + s * job->q_stride + h0 * rep * dim;
#ifdef HAS_AMX
    if (qb != NULL)
        amx_pack_queries(q, g, rep, dim, qb);
#endif
    /* With every KV head of the sequence (g = heads) a block's K rows are one contiguous
       run, and so are its V rows: the vector q.k below then sends the next block's K and
       this block's V to L2 one line each per product, so that the misses overlap with the
       products instead of queueing in a burst (the p.v pass finds V in L2). */
    const int spread = g == job->heads && qb == NULL;
    const int64_t lines = bs * row * sizeof(uint16_t) / 64;
    if (spread)
        prefetch_rows(k0 + table[0] * job->block_stride, len < bs ? len : bs, row, row * 2);
    for (int64_t p0 = 0; p0 < len; p0 += bs) {
        const int64_t n = len - p0 < bs ? len - p0 : bs;
        const uint16_t *k = k0 + table[p0 / bs] * job->block_stride;
        const char *next_k = p0 + bs < len ? (const char *)(k0 + table[p0 / bs + 1]
                                                              * job->block_stride) : NULL;
        const char *this_v = (const char *)(v0 + table[p0 / bs] * job->block_stride);
        int64_t line = spread ? 0 : lines;
        if (!spread && next_k != NULL)
            prefetch_rows((const uint16_t *)next_k, bs, row, g * dim * 2);
#ifdef HAS_AMX
        if (qb != NULL) {
            for (int64_t t = 0; t < n; t += 16)
                amx_scores(k + t * row, row, n - t, qb, g, rep, dim, job->scale, scores,
                           len, p0 + t, tile);
            continue;
        }
#endif
        for (int64_t j = 0; j < gq; j++) {  /* query head j reads KV head j / rep */
            __m512bh qv[chunks];
            for (int64_t c = 0; c < chunks; c++)
                qv[c] = (__m512bh)_mm512_loadu_si512(q + j * dim + c * 32);
            const uint16_t *kh = k + j / rep * dim;
            float *sj = scores + j * len + p0;
            for (int64_t t = 0; t < n; t++) {
                if (line < lines) {
                    if (next_k != NULL)
                        __builtin_prefetch(next_k + line * 64, 0, 2);
                    __builtin_prefetch(this_v + line * 64, 0, 2);
                    line++;
                }
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks; c++)
                    a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(
                        kh + t * row + c * 32));
                sj[t] = _mm512_reduce_add_ps(a) * job->scale;
            }
        }
    }
    float total[gq];
    for (int64_t j = 0; j < gq; j++) {
        float *sj = scores + j * len;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t p = 0; p < len; p += 16) {
            const __mmask16 live = len - p >= 16 ? 0xffff : (1u << (len - p)) - 1;
            top = _mm512_mask_max_ps(top, live, top, _mm512_maskz_loadu_ps(live, sj + p));
        }
        const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t p = 0; p < len; p += 16) {
            const __mmask16 live = len - p >= 16 ? 0xffff : (1u << (len - p)) - 1;
            const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(
                _mm512_maskz_loadu_ps(live, sj + p), peak)));
            _mm256_mask_storeu_epi16(weights + j * wlen + p, live,
                                     (__m256i)_mm512_cvtneps_pbh(e));
            sum = _mm512_add_ps(sum, e);
        }
        total[j] = _mm512_reduce_add_ps(sum);
        /* the partner of an odd last position, and the rest of a tile of keys */
        memset(weights + j * wlen + len, 0, (wlen - len) * sizeof(uint16_t));
        memset(acc + j * dim, 0, dim * sizeof(float));
    }
#ifdef HAS_AMX
    if (vt != NULL)  /* p.v on the tiles; else (and without AMX, where vt is NULL) below */
        for (int64_t h = 0; h < g; h++)
            amx_values(v0 + h * dim, table, job->block_stride, bs, row, rep, len,
                       weights + h * rep * wlen, wlen, vt, tile, acc + h * rep * dim);
#endif
    for (int64_t p0 = 0; vt == NULL && p0 < len; p0 += bs) {
        const int64_t n = len - p0 < bs ? len - p0 : bs;
        const uint16_t *v = v0 + table[p0 / bs] * job->block_stride;
        if (p0 + bs < len)
            prefetch_rows(v0 + table[p0 / bs + 1] * job->block_stride, bs, row, g * dim * 2);
        for (int64_t h = 0; h < g; h++)
            for (int64_t c = 0; c < dim / 32; c++)
                for (int64_t r = 0; r < rep; r += 4) {
                    const int64_t j = h * rep + r, nr = rep - r < 4 ? rep - r : 4;
                    const uint16_t *vc = v + h * dim + c * 32;
                    const uint32_t *w = (const uint32_t *)(weights + j * wlen + p0);
                    float *o = acc + j * dim + c * 32;
                    if (nr == 4) pv_block(vc, row, n, w, wlen / 2, o, dim, 4);
                    else if (nr == 3) pv_block(vc, row, n, w, wlen / 2, o, dim, 3);
                    else if (nr == 2) pv_block(vc, row, n, w, wlen / 2, o, dim, 2);
                    else pv_block(vc, row, n, w, wlen / 2, o, dim, 1);
                }
    }
    uint16_t *out = job->out + s * job->heads * rep * dim + h0 * rep * dim;
    for (int64_t j = 0; j < gq; j++) {
        float flat[dim];  /* acc's lanes back in dimension order (`pv_block`) */
        for (int64_t d = 0; d < dim; d++)
            flat[d] = acc[j * dim + d / 32 * 32 + (d % 8 < 4 ? 0 : 16) + d % 32 / 8 * 4 + d % 4];
        for (int64_t c = 0; c < vecs; c++)
            _mm256_storeu_si256((__m256i *)(out + j * dim + c * 16), (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(_mm512_loadu_ps(flat + c * 16), _mm512_set1_ps(1.0f / total[j]))));
    }
}

/* Returns 0, or -1 when scratch memory ran out (the caller falls back; the K/V writes may
   then have happened, which the caller's own write repeats). */
int paged_decode_bf16(const uint16_t *q, const uint16_t *k_new, const uint16_t *v_new,
                      int64_t q_stride, int64_t k_stride, int64_t v_stride, uint16_t *k,
                      int64_t v_offset, int64_t block_stride, const int64_t *tables,
                      int64_t width, const int64_t *lens, int64_t num_seqs, int64_t heads,
                      int64_t rep, int64_t dim, int64_t block_size, int64_t max_len,
                      float scale, uint16_t *out, int num_threads, int use_tiles) {
    Decode job = {q, k_new, v_new, q_stride, k_stride, v_stride, k, v_offset, block_stride,
                  tables, lens, width, num_seqs, heads, rep, dim, block_size, scale, out};
    /* whole sequences when there are enough to share out, else one KV head per item */
    const int64_t g = num_seqs >= 4 * (num_threads > 0 ? num_threads : 1) ? heads : 1;
    /* q.k on the tiles where this CPU and process have them, the blocks hold whole tiles
       of keys and a tile row holds the rep scores */
    int tiles = 0;
#ifdef HAS_AMX
    tiles = use_tiles && block_size % 16 == 0 && rep <= 16 && amx_allowed();
#endif
    int failed = 0;
    #pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(|: failed)
    {
        float *scores = malloc(sizeof(float) * g * rep * (max_len > 0 ? max_len : 1));
        float *acc = malloc(sizeof(float) * g * rep * dim);
        /* a tile of weights reads 16 query rows and 16 keys from any head's first */
        uint16_t *weights = malloc(sizeof(uint16_t) * (g * rep + 16) * (max_len + 16));
        uint32_t *qb = tiles ? malloc(sizeof(uint32_t) * g * rep * dim / 2) : NULL;
        uint16_t *vt = tiles && dim == 64 ? aligned_alloc(64, 4 * 8 * 32 * sizeof(uint16_t))
                                          : NULL;
        float tile[16 * 16];
        failed = scores == NULL || acc == NULL || weights == NULL || (tiles && qb == NULL)
                 || (tiles && dim == 64 && vt == NULL);
#ifdef HAS_AMX
        /* q.k of rep query heads: C (0) 16 keys x rep scores, A (1) 16 K rows x 32
           dimensions, B (2) the rep queries' 32 dimensions as 16 pairs */
        /* p.v of rep query heads (dim 64): C (1, 3, 4, 5) 16 query rows x 16 dimensions,
           A (6) 16 query rows x 16 keys, B (7) 8 pairs of V rows x 16 dimensions */
        if (tiles && !failed)
            amx_configure_rows(8, (const uint16_t[8]){(uint16_t)(rep * 4), 64,
                                                      (uint16_t)(rep * 4), 64, 64, 64, 32, 64},
                               (const uint8_t[8]){16, 16, 16, 16, 16, 16, 16, 8});
#endif
        #pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < num_seqs * heads / g; i++)
            if (!failed)
                decode_item(&job, scores, weights, acc, qb, vt, tile, i / (heads / g),
                            i % (heads / g) * g, g);
#ifdef HAS_AMX
        if (tiles)
            _tile_release();
#endif
        free(scores), free(acc), free(weights), free(qb), free(vt);
    }
    return failed ? -1 : 0;
}
"""

QUERIES_PER_ITEM = 96  # query vectors (rows x heads sharing a KV head) per work item
KEY_TILE = 64  # keys per packed tile (BK above)


@cache
def _library() -> ctypes.CDLL | None:
    """Compiles (once per source and flags) and loads the kernels; None when it cannot."""
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32,
                ptr, ptr, ptr, ptr, i64, i32, i32]
    lib = cpu_kernels.build_openmp("prefill_attention", _SOURCE, argtypes)
    if lib is not None:
        lib.paged_decode_bf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64,
                                          ptr, i64, i64, i64, i64, i64, i64, f32, ptr, i32, i32]
        lib.paged_decode_bf16.restype = i32
    return lib


def is_supported(q: Tensor) -> bool:
    """Whether `prefill` runs for queries like `q` on this machine."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.shape[-1] % 32 == 0
            and cpu_isa.detect().level in cpu_isa.NATIVE_BF16_LEVELS and _library() is not None)


def takes_prompts(q: Tensor) -> bool:
    """Whether prompt queries like `q` should go to `prefill` rather than torch's SDPA."""
    level = cpu_isa.detect().level
    return is_supported(q) and level in PROMPT_LEVELS and (TILES or level != "AMX")


def prefill(q: Tensor, seqs: list[tuple[int, int, int, Tensor, Tensor]], scale: float
            ) -> Tensor | None:
    """Causal attention of prompt queries, every sequence of a step in one call.

    q: `[num_tokens, heads, dim]` bf16 (heads a multiple of the KV heads; rows may be
    strided, as views of a fused projection). `seqs`: per sequence (its first row in q, its
    query count, its key count, K, V), K and V `[keys, kv_heads, dim]` bf16 with contiguous
    heads; its queries are the last query-count positions of its keys. Returns
    `[num_tokens, heads, dim]` bf16 with those rows written (others uninitialised), or None
    where the kernel cannot run (`is_supported`, unusual strides, no memory)."""
    if not seqs or not is_supported(q):
        return None
    kv_heads, dim = seqs[0][3].shape[1:]
    if (q.shape[1] % kv_heads or q.stride(2) != 1 or q.stride(1) != dim
            or any(t.dtype != torch.bfloat16 or t.shape[1:] != (kv_heads, dim)
                   or t.stride(2) != 1 or t.stride(1) != dim
                   for _, _, _, k, v in seqs for t in (k, v))):
        return None
    rep = q.shape[1] // kv_heads
    block = max(1, QUERIES_PER_ITEM // rep)  # query rows per work item
    starts, q_lens, s_lens, ks, vs = (list(c) for c in zip(*seqs))
    padded = [-(-n // KEY_TILE) * KEY_TILE for n in s_lens]
    packed_at = [0] + list(itertools.accumulate(n * 2 * kv_heads * dim for n in padded))
    packed = torch.empty(packed_at.pop(), dtype=torch.bfloat16)
    # longest sequences and their last rows (the most keys) first
    items = [(s, h, r0) for s in sorted(range(len(seqs)), key=lambda s: -s_lens[s])
             for r0 in range((q_lens[s] - 1) // block * block, -1, -block)
             for h in range(kv_heads)]
    meta = torch.tensor([starts, q_lens, s_lens, [t.data_ptr() for t in ks],
                         [t.data_ptr() for t in vs], [t.stride(0) for t in ks],
                         [t.stride(0) for t in vs], packed_at], dtype=torch.long)
    at = [meta.data_ptr() + i * len(seqs) * 8 for i in range(8)]  # its rows' addresses
    items_t = torch.tensor(items, dtype=torch.long)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    lib = _library()
    assert lib is not None  # is_supported built it
    status = lib.prefill_attention(
        q.data_ptr(), q.stride(0), *at[:7], len(seqs), kv_heads, rep, dim, block, scale,
        out.data_ptr(), packed.data_ptr(), at[7], items_t.data_ptr(), len(items),
        torch.get_num_threads(), int(TILES))
    return out if status == 0 else None


def decode(q: Tensor, kv_cache: Tensor, layer: int, block_tables: Tensor, seq_lens: Tensor,
           max_seq_len: int, scale: float, new_kv: tuple[Tensor, Tensor] | None = None
           ) -> Tensor | None:
    """`models.cpu_attention.decode` for a bf16 cache and bf16 queries (same arguments and
    result), q.k and p.v on the bf16 dot-product instruction (the weights rounded to bf16
    for p.v, as in `prefill`); None where it cannot run (`is_supported`, an odd block
    size, no memory)."""
    _, num_layers, _, block_size, kv_heads, head_dim = kv_cache.shape
    if (kv_cache.dtype != torch.bfloat16 or not kv_cache.is_contiguous() or block_size % 2
            or q.shape[1] % kv_heads or not is_supported(q)):
        return None
    lib = _library()
    assert lib is not None  # is_supported built it
    return run_paged_decode(lib.paged_decode_bf16, q, kv_cache, layer, block_tables, seq_lens,
                            max_seq_len, scale, new_kv, int(TILES))


def run_paged_decode(kernel: Callable[..., int], q: Tensor, kv_cache: Tensor, layer: int,
                     block_tables: Tensor, seq_lens: Tensor, max_seq_len: int, scale: float,
                     new_kv: tuple[Tensor, Tensor] | None, *extra: int) -> Tensor | None:
    """`decode`'s call of a bf16 paged decode kernel (`paged_decode_bf16`'s arguments,
    then ``extra``): its output, or None when the kernel failed."""
    _, num_layers, _, block_size, kv_heads, head_dim = kv_cache.shape
    q = q if q.stride(2) == 1 and q.stride(1) == head_dim else q.contiguous()
    k_new = v_new = None
    if new_kv is not None:
        k_new, v_new = (t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous()
                        for t in (x.to(torch.bfloat16) for x in new_kv))
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()  # long
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    block_elems = block_size * kv_heads * head_dim  # one K (or V) block of one layer
    status = kernel(
        q.data_ptr(), None if k_new is None else k_new.data_ptr(),
        None if v_new is None else v_new.data_ptr(), q.stride(0),
        0 if k_new is None else k_new.stride(0), 0 if v_new is None else v_new.stride(0),
        kv_cache.data_ptr() + layer * 2 * block_elems * 2, block_elems,
        num_layers * 2 * block_elems, tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        q.shape[0], kv_heads, q.shape[1] // kv_heads, head_dim, block_size, max_seq_len, scale,
        out.data_ptr(), torch.get_num_threads(), *extra)
    return out if status == 0 else None
