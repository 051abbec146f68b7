"""bf16 linear layers for the row counts of decode steps, in C: on AMX tiles, or with
AVX-512 BF16 dot products (`vdpbf16ps`) on CPUs without AMX.

A decode step multiplies a few dozen rows by every weight of the model. oneDNN's bf16 GEMM,
blocked for any shape, leaves part of the machine on the table at these rows
(docs/results-cpu.md). These kernels are built for them: each weight is packed once into the
layout of the tile product's second operand, 16 output features x 32 inputs per 1 KiB tile,
the tiles of 16 features in a row, so that every thread reads its share of the weight as
one forward stream; a 64-byte row of that tile (16 features x one input pair) is also the
second operand of one `vdpbf16ps`.

On AMX a thread takes two blocks of 16 features at a time (for SiLU(gate) x up, a gate
block and its up block) and runs 32 rows against them in four accumulator tiles, so that
each tile of rows (the first operand, loaded as the rows lie in the input) and each weight
tile serves two products; more rows take the same blocks again, from cache, while the next
two blocks are prefetched into L2 (a tile load holds up the products behind it until its
data arrives, so the stream must be ahead of it).

Without AMX a thread takes four blocks (two gate and two up blocks for SiLU(gate) x up) and
runs 4 rows at a time against them in 16 vector accumulators: per input pair, four weight
loads and four broadcast input pairs feed 16 dot products. More rows take the same blocks
again from L2, and over those passes the next four blocks go to L2, so that the first pass
over each block does not wait on memory.

Both then add the bias, apply the ReLU, the residual or SiLU(gate) x up in float32 and round
each output to bf16 once, as oneDNN's post-ops do.

`linear` returns None where it cannot run (neither AMX nor AVX-512 BF16, another dtype, a
shape that is not whole tiles, more than `MAX_ROWS` rows, no C compiler): the caller keeps
oneDNN. Built and cached by `models.cpu_kernels` (ASERVE_CPU_KERNELS=0 disables it,
ASERVE_BF16_GEMM=0 these kernels).
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache

import torch
from torch import Tensor

from models import cpu_isa, cpu_kernels
from models.cpu_bf16_attention import AMX_HEADER, HEADER

logger = logging.getLogger(__name__)

# Most rows a product takes here: decode steps. Prompts go to oneDNN, whose blocking for
# many rows is faster from about 240 rows on with AMX (without, within 3 % at 256 rows).
MAX_ROWS = 192
TILE_ROWS, TILE_INPUTS = 16, 32  # a weight tile: 16 output features x 32 inputs (16 pairs)
ENABLED = os.environ.get("ASERVE_BF16_GEMM", "1") != "0"
OPS = {"none": 0, "relu": 1, "add": 2, "silu_mul": 3}  # what follows the product

_SOURCE = cpu_kernels.VECTORS + HEADER + AMX_HEADER + r"""
#include <stdbool.h>

enum { OP_NONE, OP_RELU, OP_ADD, OP_SILU_MUL };


#ifdef HAS_AMX
/* c[t][j] (16 x 16 floats each, at c + (2 t + j) 256) = rows a[t] (16 each, t < g <= 2,
   `lda` bf16 apart) x the packed tiles b[j] (k / 32 of them, one block of 16 features
   each): each row tile and each block's tile is loaded once per 32 inputs for two
   products. Meanwhile `lines` lines of each of the blocks `next` per 32 inputs, from line
   `first` on, go to L2: a tile load stalls the products behind it until its data comes
   (tiles are not renamed), so the weights must be near before the load asks for them. */
static inline void pair_product(const uint16_t *const a[2], int g, int64_t lda,
                                const uint16_t *const b[2], int64_t steps, float *c,
                                const char *const next[2], int64_t first, int64_t lines) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t stride = lda * 2;
    for (int64_t s = 0; s < steps; s++) {
        /* the streams run ahead of the products: a line of each tile 8 steps on */
        _mm_prefetch((const char *)(b[0] + (s + 8) * 512), _MM_HINT_T0);
        _mm_prefetch((const char *)(b[1] + (s + 8) * 512), _MM_HINT_T0);
        if (next[0] != NULL)
            for (int64_t l = first + s * lines; l < first + (s + 1) * lines && l < 16 * steps;
                 l++) {
                _mm_prefetch(next[0] + l * 64, _MM_HINT_T1);
                _mm_prefetch(next[1] + l * 64, _MM_HINT_T1);
            }
        _tile_loadd(6, b[0] + s * 512, 64);
        _tile_loadd(7, b[1] + s * 512, 64);
        _tile_loadd(4, a[0] + s * 32, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (g > 1) {
            _tile_loadd(5, a[1] + s * 32, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    if (g > 1) {
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
    }
}

/* out[r][16 j, 16 j + 16) of `rows` rows from the products c (as `pair_product` leaves
   them), `bias` the block's 16 biases: op(c + bias) rounded to bf16 once */
static inline void epilogue(const float *c, int j, int64_t rows, __m512 bias, int op,
                            const uint16_t *residual, uint16_t *out, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        __m512 v = _mm512_add_ps(_mm512_load_ps(c + ((r / 16) * 2 + j) * 256 + r % 16 * 16),
                                 bias);
        if (op == OP_RELU)
            v = _mm512_max_ps(v, _mm512_setzero_ps());
        else if (op == OP_ADD)
            v = _mm512_add_ps(v, (__m512)load_bf16(residual + r * n));
        _mm256_storeu_si256((__m256i *)(out + r * n), (__m256i)_mm512_cvtneps_pbh(v));
    }
}
#endif

/* the blocks of work item `p`: (2 p, 2 p + 1), or for silu_mul (gate p, up p); an odd last
   block pairs with itself (its second product is not written) */
static inline void pair_blocks(int64_t p, int64_t blocks, bool gated, int64_t nb[2]) {
    nb[0] = gated ? p : 2 * p;
    nb[1] = gated ? blocks + p : (2 * p + 1 < blocks ? 2 * p + 1 : 2 * p);
}

#ifdef HAS_AMX
/* `bf16_linear` on AMX tiles: 1 where they cannot be used */
static int tile_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                       const uint16_t *bias, const uint16_t *residual, int op, uint16_t *out,
                       int threads) {
    if (!amx_allowed()) return 1;
    const int64_t blocks = n / 16, steps = k / 32, full = m / 16 * 16;
    /* work items: pairs of blocks, (2 i, 2 i + 1) or, for silu_mul, (gate i, up i) */
    const bool gated = op == OP_SILU_MUL;
    const int64_t pairs = gated ? blocks : (blocks + 1) / 2;
    /* the rows past the last whole tile, zero-padded to one: read by every thread */
    uint16_t *tail = NULL;
    if (full < m) {
        tail = calloc(16 * k, sizeof(uint16_t));
        if (tail == NULL) return 1;
        memcpy(tail, x + full * k, (size_t)(m - full) * k * sizeof(uint16_t));
    }
    /* Past 32 rows a pair's later passes read its blocks from cache and leave memory idle,
       and its first pass waits on every weight tile: instead the next pair's blocks go to
       L2 over this pair's passes, `lines` lines of each per 32 inputs. (With one pass the
       stream is never idle, and the hardware's prefetch keeps up with it.) */
    const int64_t passes = (m + 31) / 32, lines = (16 + passes - 1) / passes;
    #pragma omp parallel num_threads(threads)
    {
        amx_configure(8, (const uint16_t[8]){64, 64, 64, 64, 64, 64, 64, 64});
        float c[64 * 16] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            int64_t nb[2], next_nb[2];
            pair_blocks(p, blocks, gated, nb);
            const uint16_t *b[2] = {w + nb[0] * steps * 512, w + nb[1] * steps * 512};
            const char *next[2] = {NULL, NULL};
            if (p + 1 < pairs && passes > 1) {
                pair_blocks(p + 1, blocks, gated, next_nb);
                for (int j = 0; j < 2; j++)
                    next[j] = (const char *)(w + next_nb[j] * steps * 512);
            }
            const __m512 zero = _mm512_setzero_ps();
            const __m512 bias_v[2] = {bias ? (__m512)load_bf16(bias + nb[0] * 16) : zero,
                                      bias ? (__m512)load_bf16(bias + nb[1] * 16) : zero};
            for (int64_t m0 = 0; m0 < m; m0 += 32) {
                const int64_t rows = m - m0 < 32 ? m - m0 : 32;
                const int g = rows > 16 ? 2 : 1;
                const uint16_t *a[2];
                for (int t = 0; t < 2; t++)
                    a[t] = m0 + 16 * t < full ? x + (m0 + 16 * t) * k : tail;
                pair_product(a, g, k, b, steps, c, next, m0 / 32 * steps * lines, lines);
                if (!gated) {
                    for (int j = 0; j < (nb[1] != nb[0] ? 2 : 1); j++)
                        epilogue(c, j, rows, bias_v[j], op,
                                 residual ? residual + m0 * n + nb[j] * 16 : NULL,
                                 out + m0 * n + nb[j] * 16, n);
                    continue;
                }
                for (int64_t r = 0; r < rows; r++) {
                    /* silu(gate), rounded to bf16 as a GEMM's output, times up */
                    const float *row = c + (r / 16) * 512 + r % 16 * 16;
                    const __m512 gate = _mm512_add_ps(_mm512_load_ps(row), bias_v[0]);
                    __m512 s = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(
                        _mm512_sub_ps(zero, gate))));
                    s = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(s));
                    const __m512 v = _mm512_mul_ps(
                        _mm512_add_ps(_mm512_load_ps(row + 256), bias_v[1]), s);
                    _mm256_storeu_si256((__m256i *)(out + (m0 + r) * n + p * 16),
                                        (__m256i)_mm512_cvtneps_pbh(v));
                }
            }
        }
        _tile_release();
    }
    free(tail);
    return 0;
}
#endif

#ifdef __AVX512BF16__
enum { VR = 4, VJ = 4 };  /* rows x blocks of 16 features per pass: 16 accumulators */

/* the blocks of work item `q`: 4 q .. 4 q + 3, or for silu_mul gate 2 q, 2 q + 1, then up
   2 q, 2 q + 1; past the last block, the last again (its products are not written) */
static inline void quad_blocks(int64_t q, int64_t blocks, bool gated, int64_t nb[VJ]) {
    const int64_t half = blocks / 2;  /* silu_mul: gate blocks [0, half), up blocks after */
    for (int j = 0; j < VJ; j++) {
        const int64_t b = gated ? 2 * q + j % 2 : VJ * q + j;
        nb[j] = gated ? (b < half ? b : half - 1) + (j >= 2 ? half : 0)
                      : (b < blocks ? b : blocks - 1);
    }
}

/* Rows x[0 .. rows) (`k` bf16 each, rows <= VR) times the 4 blocks b[j] (packed, `pairs`
   input pairs): out[r][nb[j] 16 ..] = op(product + bias), `n` outputs per row (for
   silu_mul, j = 0, 1 gates and 2, 3 ups). Meanwhile line `*line` on of the next item's
   blocks next[j] (`per_block` lines each) go to L2, `lpp` lines per pass, one every
   pairs / lpp input pairs. */
static inline __attribute__((always_inline)) void quad_pass(
        int rows, const uint16_t *x, int64_t k, const uint16_t *const b[VJ], int64_t pairs,
        const __m512 bias[VJ], int op, const int64_t nb[VJ], const uint16_t *residual,
        uint16_t *out, int64_t n, const char *const next[VJ], int64_t per_block,
        int64_t lpp, int64_t *line) {
    __m512 acc[VR][VJ];
    for (int r = 0; r < VR; r++)
        for (int j = 0; j < VJ; j++) acc[r][j] = _mm512_setzero_ps();
    int64_t credit = 0;
    for (int64_t p = 0; p < pairs; p++) {
        if ((credit += lpp) >= pairs) {
            credit -= pairs;
            const int64_t j = *line / per_block;
            if (j < VJ && next[j] != NULL)
                _mm_prefetch(next[j] + *line % per_block * 64, _MM_HINT_T1);
            ++*line;
        }
        __m512bh w[VJ];
        for (int j = 0; j < VJ; j++) w[j] = (__m512bh)_mm512_loadu_si512(b[j] + p * 32);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * k + 2 * p, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < VJ; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, w[j]);
        }
    }
    for (int r = 0; r < rows; r++) {
        if (op == OP_SILU_MUL) {
            for (int j = 0; j < 2; j++) {
                if (j > 0 && nb[j] == nb[j - 1]) break;
                /* silu(gate), rounded to bf16 as a GEMM's output, times up */
                const __m512 gate = _mm512_add_ps(acc[r][j], bias[j]);
                __m512 s = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(
                    _mm512_sub_ps(_mm512_setzero_ps(), gate))));
                s = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(s));
                const __m512 v = _mm512_mul_ps(_mm512_add_ps(acc[r][j + 2], bias[j + 2]), s);
                _mm256_storeu_si256((__m256i *)(out + r * n + nb[j] * 16),
                                    (__m256i)_mm512_cvtneps_pbh(v));
            }
            continue;
        }
        for (int j = 0; j < VJ; j++) {
            if (j > 0 && nb[j] == nb[j - 1]) break;
            __m512 v = _mm512_add_ps(acc[r][j], bias[j]);
            if (op == OP_RELU)
                v = _mm512_max_ps(v, _mm512_setzero_ps());
            else if (op == OP_ADD)
                v = _mm512_add_ps(v, (__m512)load_bf16(residual + r * n + nb[j] * 16));
            _mm256_storeu_si256((__m256i *)(out + r * n + nb[j] * 16),
                                (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* `quad_pass` for each row count, so that each unrolls with its accumulators in registers */
#define QUAD_PASS_ARGS const uint16_t *x, int64_t k, const uint16_t *const b[VJ], \
    int64_t pairs, const __m512 bias[VJ], int op, const int64_t nb[VJ], \
    const uint16_t *residual, uint16_t *out, int64_t n, const char *const next[VJ], \
    int64_t per_block, int64_t lpp, int64_t *line
#define QUAD_PASS(R) static void quad_pass_##R(QUAD_PASS_ARGS) { \
    quad_pass(R, x, k, b, pairs, bias, op, nb, residual, out, n, next, per_block, lpp, line); }
QUAD_PASS(1) QUAD_PASS(2) QUAD_PASS(3) QUAD_PASS(4)
static void (*const quad_passes[VR + 1])(QUAD_PASS_ARGS) = {
    NULL, quad_pass_1, quad_pass_2, quad_pass_3, quad_pass_4};

/* `bf16_linear` with AVX-512 BF16 dot products */
static int vector_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                         const uint16_t *bias, const uint16_t *residual, int op,
                         uint16_t *out, int threads) {
    const bool gated = op == OP_SILU_MUL;
    const int64_t blocks = (gated ? 2 * n : n) / 16, steps = k / 32;
    const int64_t per_block = steps * 16;  /* cache lines of one block */
    const int64_t items = gated ? (blocks / 2 + 1) / 2 : (blocks + VJ - 1) / VJ;
    const int64_t passes = (m + VR - 1) / VR;
    /* the next item's 4 blocks over this item's passes (with one pass the stream never
       idles, and the hardware's prefetch keeps up with it) */
    const int64_t lpp = passes > 1 ? (VJ * per_block + passes - 1) / passes : 0;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t q = 0; q < items; q++) {
        int64_t nb[VJ], next_nb[VJ];
        quad_blocks(q, blocks, gated, nb);
        const uint16_t *b[VJ];
        const char *next[VJ] = {NULL, NULL, NULL, NULL};
        __m512 bias_v[VJ];
        if (q + 1 < items && lpp > 0) quad_blocks(q + 1, blocks, gated, next_nb);
        for (int j = 0; j < VJ; j++) {
            b[j] = w + nb[j] * steps * 512;
            bias_v[j] = bias ? (__m512)load_bf16(bias + nb[j] * 16) : _mm512_setzero_ps();
            if (q + 1 < items && lpp > 0 && (j == 0 || next_nb[j] != next_nb[j - 1]))
                next[j] = (const char *)(w + next_nb[j] * steps * 512);
        }
        int64_t line = 0;
        for (int64_t m0 = 0; m0 < m; m0 += VR) {
            const int64_t rows = m - m0 < VR ? m - m0 : VR;
            quad_passes[rows](x + m0 * k, k, b, k / 2, bias_v, op, nb,
                              residual ? residual + m0 * n : NULL, out + m0 * n, n, next,
                              per_block, lpp, &line);
        }
    }
    return 0;
}
#endif

/* out[m][n] = op(x[m] . w[n] + bias[n]) in bf16 for m rows of x (k bf16 each), w packed by
   `models.cpu_bf16_gemm.pack` ([n / 16][k / 32][16 input pairs][16 features][2]). op: none,
   ReLU, + residual[m][n], or silu(gate) * up, where w holds 2 n features (gate, then up) and
   bias 2 n. On AMX tiles where `tiles` and the CPU allow, else with AVX-512 BF16 vectors.
   Returns 1 where neither can run (the caller computes it elsewhere). */
int bf16_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                const uint16_t *bias, const uint16_t *residual, int op, uint16_t *out,
                int tiles, int threads) {
    if (k % 32 || n % 16) return 1;
#ifdef HAS_AMX
    if (tiles && tile_linear(x, m, k, w, n, bias, residual, op, out, threads) == 0) return 0;
#endif
#ifdef __AVX512BF16__
    return vector_linear(x, m, k, w, n, bias, residual, op, out, threads);
#else
    (void)x, (void)m, (void)k, (void)w, (void)n, (void)bias, (void)residual, (void)op;
    (void)out, (void)tiles, (void)threads;
    return 1;
#endif
}
"""


@cache
def _library() -> ctypes.CDLL | None:
    """Compiles (once per source and flags) and loads the kernel; None when it cannot, or
    when it was built for a CPU without AVX-512 BF16 (an older `ASERVE_MARCH`), where it
    declines every product."""
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib = cpu_kernels.build_openmp(
        "bf16_linear", _SOURCE, [ptr, i64, i64, ptr, i64, ptr, ptr, i32, ptr, i32, i32])
    if lib is None:
        return None
    x, w = torch.zeros(TILE_INPUTS, dtype=torch.bfloat16), torch.zeros(
        TILE_ROWS * TILE_INPUTS, dtype=torch.bfloat16)
    out = torch.empty(TILE_ROWS, dtype=torch.bfloat16)
    if lib.bf16_linear(x.data_ptr(), 1, TILE_INPUTS, w.data_ptr(), TILE_ROWS, None, None, 0,
                       out.data_ptr(), 0, 1) != 0:
        logger.info("bf16_linear was built without AVX-512 BF16 (-march=%s): not used",
                    cpu_kernels.march())
        return None
    return lib


def is_available() -> bool:
    """Whether this CPU has AMX or AVX-512 BF16 and the kernel is built (it may still
    decline a shape)."""
    return (ENABLED and cpu_isa.detect().level in cpu_isa.NATIVE_BF16_LEVELS
            and _library() is not None)


def has_tiles() -> bool:
    """Whether `linear` can take AMX tiles here (else it takes AVX-512 BF16 vectors)."""
    return is_available() and cpu_isa.detect().level == "AMX"


def fits(weight: Tensor) -> bool:
    """Whether `weight` ([out, in]) can be packed: bf16, whole tiles."""
    return (weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % TILE_ROWS == 0 and weight.shape[1] % TILE_INPUTS == 0)


def pack(weight: Tensor) -> Tensor:
    """`weight` ([out, in], bf16, `fits`) as the tiles `linear` reads: per block of 16
    output features, per 32 inputs, the 16 input pairs x 16 features x 2 of a tile."""
    out, inputs = weight.shape
    tiles = weight.reshape(out // TILE_ROWS, TILE_ROWS, inputs // TILE_INPUTS,
                           TILE_INPUTS // 2, 2)
    return tiles.permute(0, 2, 3, 1, 4).contiguous()


def linear(x: Tensor, packed: Tensor, bias: Tensor | None = None, op: str = "none",
           residual: Tensor | None = None, tiles: bool = True) -> Tensor | None:
    """`op(x @ weight.T + bias)` in bf16 for `packed` = `pack(weight)`: op "none", "relu",
    "add" (+ `residual`, [rows, out]) or "silu_mul" (weight and bias hold gate, then up:
    silu(gate) * up), on AMX tiles where the CPU has them and `tiles`, else with AVX-512
    BF16 vectors. None where the kernel declines (see the module docstring)."""
    rows = x.shape[0]
    if (rows > MAX_ROWS or rows == 0 or x.dtype != torch.bfloat16 or x.dim() != 2
            or any(t is not None and t.dtype != torch.bfloat16 for t in (bias, residual))):
        return None
    lib = _library()
    if lib is None:
        return None
    blocks, steps = packed.shape[0], packed.shape[1]
    inputs, features = steps * TILE_INPUTS, blocks * TILE_ROWS
    if x.shape[1] != inputs:
        raise ValueError(f"input has {x.shape[1]} features, the weight takes {inputs}")
    if op == "silu_mul":
        features //= 2
    x = x.contiguous()
    out = torch.empty(rows, features, dtype=torch.bfloat16)
    if residual is not None:
        residual = residual.contiguous()
    failed = lib.bf16_linear(
        x.data_ptr(), rows, inputs, packed.data_ptr(), features,
        0 if bias is None else bias.data_ptr(), 0 if residual is None else residual.data_ptr(),
        OPS[op], out.data_ptr(), int(tiles), torch.get_num_threads())
    return None if failed else out
