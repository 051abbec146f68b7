"""CUDA graphs of decode forwards, captured lazily per (batch bucket, block-table width bucket).

Used by `ModelRunner` on CUDA devices when the attention backend launches the same kernels for
any lengths (`GRAPH_BACKENDS`). Replays a captured forward with the step's inputs copied into
static buffers; returns None when a step cannot use a graph, and the caller runs eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from models.attention import AttentionBackend, AttentionMetadata
from models.backends import GRAPH_BACKENDS
from models.opt import OPTForCausalLM
from transport.blocks import PAD_BLOCK_ID

logger = logging.getLogger(__name__)
GRAPH_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # those backends' kernel dtypes
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # sequences
MIN_WIDTH_BUCKET = 16  # blocks; block-table widths are captured at powers of two from here
WARMUP_RUNS = 2  # eager runs before a capture (compiles kernels, sizes workspaces)


def bucket_at_least(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n, or None when n exceeds every bucket."""
    return next((b for b in buckets if b >= n), None)


def width_bucket(width: int, max_width: int) -> int | None:
    """Block-table width to capture for `width` blocks: a power of two >= MIN_WIDTH_BUCKET,
    capped at `max_width` (the widest table a sequence can need); None beyond it."""
    if width > max_width:
        return None
    bucket = MIN_WIDTH_BUCKET
    while bucket < width:
        bucket *= 2
    return min(bucket, max_width)


@dataclass(slots=True)
class _Graph:
    """One captured decode forward and the static tensors it reads and writes."""

    input_ids: Tensor  # [batch] long
    positions: Tensor  # [batch] long
    meta: AttentionMetadata  # static slot_mapping, seq_lens, block_tables [batch, width]
    hidden: Tensor  # [batch, proj_dim] output
    graph: torch.cuda.CUDAGraph | None  # None in eager mode (CPU dry runs)

    def replay(self, model: OPTForCausalLM, kv_cache: Tensor, backend: AttentionBackend
               ) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        _forward_into(self, model, kv_cache, backend)


class DecodeGraphs:
    """Decode forwards of one model as CUDA graphs, one per (kv cache, batch, width) bucket.

    Padding rows of a bucket read and write slot 0 of the null block (`PAD_BLOCK_ID`), which
    each forward zeroes again at its end. The tensor `forward` returns is a view of the graph's
    static output: valid until the next call.

    Args:
        model: the model, on its CUDA device, in eval mode.
        backend: its attention backend; graphs are used only for `GRAPH_BACKENDS`.
        block_size: tokens per KV block.
        max_blocks_per_seq: widest block table a sequence can need.
        use_graphs: False runs the same padded static-buffer path eagerly (CPU dry runs).
    """

    def __init__(self, model: OPTForCausalLM, backend: AttentionBackend, block_size: int,
                 max_blocks_per_seq: int, max_batch_size: int = 256,
                 use_graphs: bool = True) -> None:
        if max_batch_size > BATCH_BUCKETS[-1]:
            raise ValueError(f"max_batch_size ({max_batch_size}) must be <= {BATCH_BUCKETS[-1]}")
        self.model, self.backend = model, backend
        self.block_size, self.max_width = block_size, max_blocks_per_seq
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch_size) + (
            bucket_at_least(max_batch_size, BATCH_BUCKETS) or max_batch_size,)
        self.use_graphs = use_graphs
        dtype = next(model.parameters()).dtype  # the embedding table's (any family)
        self.is_enabled = backend.name in GRAPH_BACKENDS and dtype in GRAPH_DTYPES
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.graphs: dict[tuple[int, ...], _Graph] = {}

    def forward(self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata) -> Tensor | None:
        """`[num_seqs, proj_dim]` hidden states of a decode step, or None (run eagerly)."""
        if not (self.is_enabled and meta.is_decode):
            return None
        num_seqs, width = meta.num_seqs, int(meta.block_tables.shape[1])
        batch = bucket_at_least(num_seqs, self.buckets)
        padded_width = width_bucket(width, self.max_width)
        if batch is None or padded_width is None:
            return None
        key = (kv_cache.data_ptr(), *kv_cache.shape, batch, padded_width)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(kv_cache, batch, padded_width)
        _load_inputs(graph, input_ids, positions, meta)
        graph.replay(self.model, kv_cache, self.backend)
        return graph.hidden[:num_seqs]

    def _capture(self, kv_cache: Tensor, batch: int, width: int) -> _Graph:
        graph = _static_graph(self.model, kv_cache, batch, width, self.block_size)
        if not self.use_graphs:
            return graph
        side = torch.cuda.Stream(kv_cache.device)
        side.wait_stream(torch.cuda.current_stream(kv_cache.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                _forward_into(graph, self.model, kv_cache, self.backend)
        torch.cuda.current_stream(kv_cache.device).wait_stream(side)
        graph.graph = torch.cuda.CUDAGraph()
        # NOTE: thread_local: the copy worker thread keeps issuing copies during a capture.
        with torch.cuda.graph(graph.graph, pool=self.pool, capture_error_mode="thread_local"):
            _forward_into(graph, self.model, kv_cache, self.backend)
        logger.info("captured a decode graph: batch %d, width %d blocks", batch, width)
        return graph


def _static_graph(model: OPTForCausalLM, kv_cache: Tensor, batch: int, width: int,
                  block_size: int) -> _Graph:
    """Static buffers of a padding-only batch: every row is token 0 at position 0 in slot 0."""
    device = kv_cache.device

    def longs(shape: tuple[int, ...], value: int) -> Tensor:
        return torch.full(shape, value, dtype=torch.long, device=device)

    meta = AttentionMetadata(
        slot_mapping=longs((batch,), PAD_BLOCK_ID * block_size),  # [batch]
        query_start_loc=torch.arange(batch + 1, dtype=torch.long, device=device),  # [batch + 1]
        seq_lens=longs((batch,), 1),  # [batch]
        block_tables=longs((batch, width), PAD_BLOCK_ID),  # [batch, width]
        query_lens_list=[1] * batch, seq_lens_list=[1] * batch, block_size=block_size)
    proj_dim = model.config.word_embed_proj_dim
    dtype = next(model.parameters()).dtype  # the embedding table's (any family)
    hidden = torch.zeros(batch, proj_dim, dtype=dtype, device=device)  # [batch, proj_dim]
    return _Graph(longs((batch,), 0), longs((batch,), 0), meta, hidden, None)


def _forward_into(graph: _Graph, model: OPTForCausalLM, kv_cache: Tensor,
                  backend: AttentionBackend) -> None:
    """The captured work: one forward into the static output, then re-zero the null block."""
    hidden = model(graph.input_ids, graph.positions, kv_cache, graph.meta, backend)
    graph.hidden.copy_(hidden)  # [batch, proj_dim]
    kv_cache[PAD_BLOCK_ID].zero_()


def _load_inputs(graph: _Graph, input_ids: Tensor, positions: Tensor,
                 meta: AttentionMetadata) -> None:
    """Copies a step into the static buffers; rows past the step become padding again."""
    n, width = meta.num_seqs, meta.block_tables.shape[1]
    static = graph.meta
    graph.input_ids[:n].copy_(input_ids)
    graph.input_ids[n:].zero_()
    graph.positions[:n].copy_(positions)
    graph.positions[n:].zero_()
    static.slot_mapping[:n].copy_(meta.slot_mapping)
    static.slot_mapping[n:].fill_(PAD_BLOCK_ID * meta.block_size)
    static.seq_lens[:n].copy_(meta.seq_lens)
    static.seq_lens[n:].fill_(1)
    static.block_tables[:n, :width].copy_(meta.block_tables)
    static.block_tables[:n, width:].fill_(PAD_BLOCK_ID)
    static.block_tables[n:].fill_(PAD_BLOCK_ID)
    # NOTE: graphs never read these; eager dry runs (reference backends) do.
    static.seq_lens_list[:n] = meta.seq_lens_list
    static.seq_lens_list[n:] = [1] * (len(static.seq_lens_list) - n)
    static.workspace.clear()
