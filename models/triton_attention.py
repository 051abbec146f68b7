"""Triton decode attention over the paged KV cache: per-sequence (in batch order or
longest-first) and split-K (flash-decoding).

Decode steps (one query per sequence) run a Triton kernel; prefill and mixed steps, and tensors
on a device Triton cannot launch on, fall back to the `paged` reference backend. Knows tensors only.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor, argsort, bfloat16, empty, float16, float32
from triton.runtime.interpreter import InterpretedFunction

from models.attention import AttentionBackend, AttentionMetadata, PagedBackend

KERNEL_DTYPES = (float16, bfloat16, float32)  # other dtypes take the reference path
TILE_TOKENS = 64  # KV positions one loop iteration of a program reads
MIN_CHUNK_TOKENS = 256  # split-K: smallest chunk of a sequence given to one program
MAX_CHUNKS = 32  # split-K: most chunks per sequence (larger contexts get larger chunks)
LOG2E = 1.4426950408889634  # the kernels use exp2; scores are pre-multiplied by log2(e)


@triton.jit
def _attend_range(  # type: ignore[no-untyped-def]
        q, kv_ptr, table_ptr, start, end, seq_len, layer_offset, v_offset,
        stride_block, stride_token, head_offset, d, d_mask,
        BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):
    """Online softmax of `q` over KV positions [start, end): returns (acc, max, sum), log2."""
    m = -float("inf")
    s_sum = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tile_start in range(start, end, TILE):
        pos = tile_start + tl.arange(0, TILE)  # [TILE]
        pos_mask = pos < seq_len
        block_ids = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0)
        rows = (block_ids.to(tl.int64) * stride_block + layer_offset
                + (pos % BLOCK_SIZE) * stride_token + head_offset)  # [TILE]
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1)  # [TILE]
        scores = tl.where(pos_mask, scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new)  # [TILE]
        v = tl.load(kv_ptr + v_offset + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        s_sum = s_sum * alpha + tl.sum(p, axis=0)
        m = m_new
    return acc, m, s_sum


@triton.jit
def _decode_kernel(  # type: ignore[no-untyped-def]
        out_ptr, q_ptr, kv_ptr, tables_ptr, seq_lens_ptr, order_ptr, scale,
        stride_qs, stride_qh, stride_os, stride_oh, stride_table,
        layer_offset, v_offset, stride_block, stride_token,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
        NUM_HEADS: tl.constexpr, LPT: tl.constexpr, GROUP: tl.constexpr):
    """One program per (sequence, head) walks all of that sequence's blocks (unbalanced);
    query head `head` reads KV head `head // GROUP` (grouped-query attention).

    Batch order: a (num_seqs, num_heads) grid, program (seq, head). LPT: a 1-D grid whose
    program i takes the (i // NUM_HEADS)-th longest sequence (`order_ptr`, a permutation)
    and head i % NUM_HEADS, so programs are issued longest-first; each writes its own row,
    so the output is in batch order either way.
    """
    if LPT:
        rank = tl.program_id(0) // NUM_HEADS
        head = tl.program_id(0) % NUM_HEADS
        seq = tl.load(order_ptr + rank)
    else:
        seq = tl.program_id(0)
        head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + head * stride_qh + d, mask=d_mask, other=0.0)
    q = q.to(tl.float32) * scale
    acc, m, s_sum = _attend_range(q, kv_ptr, tables_ptr + seq * stride_table, 0, seq_len,
                                  seq_len, layer_offset, v_offset, stride_block, stride_token,
                                  (head // GROUP) * HEAD_DIM, d, d_mask, BLOCK_D, BLOCK_SIZE,
                                  TILE)
    out = acc / s_sum
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _split_kernel(  # type: ignore[no-untyped-def]
        part_acc_ptr, part_ml_ptr, q_ptr, kv_ptr, tables_ptr, seq_lens_ptr, scale,
        chunk_tokens, stride_qs, stride_qh, stride_table,
        layer_offset, v_offset, stride_block, stride_token,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, GROUP: tl.constexpr):
    """One program per (sequence, head, chunk): a partial softmax over one chunk of blocks.
    Query head `head` reads KV head `head // GROUP` (grouped-query attention)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = chunk * chunk_tokens
    if start < seq_len:
        end = tl.minimum(start + chunk_tokens, seq_len)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_qs + head * stride_qh + d, mask=d_mask, other=0.0)
        q = q.to(tl.float32) * scale
        acc, m, s_sum = _attend_range(q, kv_ptr, tables_ptr + seq * stride_table, start, end,
                                      seq_len, layer_offset, v_offset, stride_block,
                                      stride_token, (head // GROUP) * HEAD_DIM, d, d_mask,
                                      BLOCK_D, BLOCK_SIZE, TILE)
        part = (seq * tl.num_programs(1) + head) * tl.num_programs(2) + chunk
        tl.store(part_acc_ptr + part * BLOCK_D + d, acc)
        tl.store(part_ml_ptr + part * 2, m)
        tl.store(part_ml_ptr + part * 2 + 1, s_sum)


@triton.jit
def _merge_kernel(  # type: ignore[no-untyped-def]
        out_ptr, part_acc_ptr, part_ml_ptr, seq_lens_ptr, chunk_tokens, num_chunks,
        stride_os, stride_oh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNKS_P2: tl.constexpr):
    """One program per (sequence, head): log-sum-exp merge of that sequence's chunk partials."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = (seq_len + chunk_tokens - 1) // chunk_tokens
    c = tl.arange(0, CHUNKS_P2)
    c_mask = c < used
    part = (seq * tl.num_programs(1) + head) * num_chunks + c  # [CHUNKS_P2]
    m = tl.load(part_ml_ptr + part * 2, mask=c_mask, other=-float("inf"))
    s_sum = tl.load(part_ml_ptr + part * 2 + 1, mask=c_mask, other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))  # [CHUNKS_P2], 0 for unused chunks
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=c_mask[:, None],
                  other=0.0)  # [CHUNKS_P2, BLOCK_D]
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * s_sum, axis=0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# NOTE: triton decides at decoration time whether kernels are compiled or interpreted.
IS_INTERPRETED = isinstance(_decode_kernel, InterpretedFunction)


class TritonDecodeBackend(PagedBackend):
    """`triton`: vLLM-v1-style paged decode, one program per (sequence, head).

    Kernels launch on CUDA tensors, or on any tensors when Triton runs in its interpreter
    (`TRITON_INTERPRET=1` set before triton is first imported; used by the CPU tests). Other
    steps (prefill, mixed, other devices or dtypes) take the inherited `paged` path.
    """

    name = "triton"
    longest_first = False  # programs in batch order (see TritonLongestFirstBackend)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, layer: int,
               meta: AttentionMetadata, scale: float) -> Tensor:
        """Writes the K/V, then `forward` (not the CPU kernel `paged` fuses the write into)."""
        return AttentionBackend.attend(self, q, k, v, kv_cache, layer, meta, scale)

    def forward(self, q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata,
                scale: float, k: Tensor | None = None, v: Tensor | None = None) -> Tensor:
        """See `AttentionBackend.forward`; only decode steps use the kernel."""
        is_launchable = q.device.type == "cuda" or IS_INTERPRETED
        if not (meta.is_decode and is_launchable and q.dtype in KERNEL_DTYPES):
            return super().forward(q, kv_cache, layer, meta, scale, k, v)
        if not kv_cache.is_contiguous():
            raise ValueError(f"kv_cache must be contiguous, got strides {kv_cache.stride()}")
        out = empty(q.shape, dtype=q.dtype, device=q.device)  # [num_seqs, num_heads, head_dim]
        self._launch(out, q, kv_cache, layer, meta, scale * LOG2E)
        return out

    def _launch(self, out: Tensor, q: Tensor, kv_cache: Tensor, layer: int,
                meta: AttentionMetadata, scale: float) -> None:
        num_seqs, num_heads, head_dim = q.shape
        if self.longest_first:
            grid: tuple[int, ...] = (num_seqs * num_heads,)
            order = argsort(meta.seq_lens, descending=True, stable=True)
        else:
            grid, order = (num_seqs, num_heads), meta.seq_lens  # order: unread placeholder
        _decode_kernel[grid](
            out, q, kv_cache, meta.block_tables, meta.seq_lens, order, scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
            *_cache_strides(kv_cache, layer),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=kv_cache.shape[3], TILE=TILE_TOKENS, NUM_HEADS=num_heads,
            LPT=self.longest_first, GROUP=num_heads // kv_cache.shape[4])


class TritonLongestFirstBackend(TritonDecodeBackend):
    """`triton-lpt`: the per-sequence kernel with its programs issued longest-first
    (longest-processing-time order), so a long sequence starts at once instead of after
    the short ones queued before it. The GPU's block scheduler still decides when each
    program runs; the order is the only change, and every output is the same bits.
    """

    name = "triton-lpt"
    longest_first = True


class TritonSplitKBackend(TritonDecodeBackend):
    """`triton-splitk`: flash-decoding; each sequence's KV is split into chunks that separate
    programs attend, then one merge program per (sequence, head) combines them (log-sum-exp).

    The chunk grid depends only on the block-table width, never on the lengths, so a decode
    step is the same launch for any lengths (CUDA graphs capture it once per width).
    """

    name = "triton-splitk"

    def _launch(self, out: Tensor, q: Tensor, kv_cache: Tensor, layer: int,
                meta: AttentionMetadata, scale: float) -> None:
        num_seqs, num_heads, head_dim = q.shape
        block_d = triton.next_power_of_2(head_dim)
        chunk_tokens, num_chunks = split_plan(meta.block_tables.shape[1] * kv_cache.shape[3])
        part_acc = empty((num_seqs, num_heads, num_chunks, block_d), dtype=float32,
                         device=q.device)  # [num_seqs, num_heads, num_chunks, block_d]
        part_ml = empty((num_seqs, num_heads, num_chunks, 2), dtype=float32,
                        device=q.device)  # [num_seqs, num_heads, num_chunks, (max, sum)]
        _split_kernel[(num_seqs, num_heads, num_chunks)](
            part_acc, part_ml, q, kv_cache, meta.block_tables, meta.seq_lens, scale,
            chunk_tokens, q.stride(0), q.stride(1), meta.block_tables.stride(0),
            *_cache_strides(kv_cache, layer),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=kv_cache.shape[3], TILE=TILE_TOKENS,
            GROUP=num_heads // kv_cache.shape[4])
        _merge_kernel[(num_seqs, num_heads)](
            out, part_acc, part_ml, meta.seq_lens, chunk_tokens, num_chunks,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, CHUNKS_P2=triton.next_power_of_2(num_chunks))


def split_plan(max_tokens: int) -> tuple[int, int]:
    """(chunk_tokens, num_chunks) covering `max_tokens` positions: chunks of at least
    MIN_CHUNK_TOKENS, a multiple of TILE_TOKENS, and at most MAX_CHUNKS of them."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= 1")
    chunk = max(MIN_CHUNK_TOKENS, -(-max_tokens // MAX_CHUNKS))
    chunk = -(-chunk // TILE_TOKENS) * TILE_TOKENS
    return chunk, -(-max_tokens // chunk)


def _cache_strides(kv_cache: Tensor, layer: int) -> tuple[int, int, int, int]:
    """(layer_offset, v_offset, stride_block, stride_token) in elements of the block-major
    `[num_blocks, num_layers, 2, block_size, num_heads, head_dim]` cache."""
    stride_block, stride_layer, stride_kv, stride_token = kv_cache.stride()[:4]
    return layer * stride_layer, stride_kv, stride_block, stride_token
