"""Attention over the paged KV cache: metadata, KV writes, `paged` and `padded` backends.

Owns only tensor math. The KV cache tensor itself is owned by transport/ and passed in:
`kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (block-major).
Queries may have more heads than the cache (grouped-query attention): query head h reads
KV head h // (num_heads / num_kv_heads), as transformers' `repeat_kv` lays them out.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models import cpu_attention, cpu_bf16_attention, cpu_kv_write
from models.backends import TORCH_BACKENDS, build_backend

BACKEND_NAMES = TORCH_BACKENDS  # the backends of this module (registered in models.backends)

# NOTE: the paged decode builds a CSR pattern per layer; silence torch's one-time beta notice.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Describes one forward over a packed batch of sequences (no padding of tokens).

    Each sequence i contributes query_lens[i] new tokens (1 for decode; the whole or a
    chunk of the prompt for prefill), attending to seq_lens[i] KV entries in total (its
    cached prefix plus the new tokens, causal):

        positions 0 .............. seq_len - query_len ........... seq_len - 1
                  |<-- cached prefix -->|<------ new tokens (queries) ------>|
    """

    slot_mapping: Tensor  # [num_tokens] long: where each new token's K/V is written
    query_start_loc: Tensor  # [num_seqs + 1] long, cumulative query lengths
    seq_lens: Tensor  # [num_seqs] long, KV length after this step
    block_tables: Tensor  # [num_seqs, max_blocks_per_seq] long, padded with 0
    query_lens_list: list[int]  # python copies, for CPU loops without .tolist() syncs
    seq_lens_list: list[int]
    block_size: int  # tokens per KV block
    # NOTE: per-forward scratch (index tensors shared by all layers); not part of equality.
    workspace: dict[str, DecodeIndex] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode(self) -> bool:
        """True when every sequence has exactly one new token."""
        return all(n == 1 for n in self.query_lens_list)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Builds the tensors of one forward; raises ValueError on inconsistent input."""
        _validate(query_lens, seq_lens, block_tables, block_size)
        slots = [
            table[pos // block_size] * block_size + pos % block_size
            for q_len, s_len, table in zip(query_lens, seq_lens, block_tables)
            for pos in range(s_len - q_len, s_len)
        ]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        width = max(len(t) for t in block_tables)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]

        def as_long(values: list[int] | list[list[int]]) -> Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            slot_mapping=as_long(slots),
            query_start_loc=as_long(starts),
            seq_lens=as_long(seq_lens),
            block_tables=as_long(padded),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            block_size=block_size,
        )


def _validate(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> None:
    if block_size < 1:
        raise ValueError(f"block_size ({block_size}) must be >= 1")
    if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not seq_lens:
        raise ValueError(
            f"query_lens ({len(query_lens)}), seq_lens ({len(seq_lens)}) and block_tables "
            f"({len(block_tables)}) must have the same non-zero length"
        )
    for i, (q_len, s_len, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if not 1 <= q_len <= s_len:
            raise ValueError(f"seq {i}: query_len ({q_len}) must be in 1..seq_len ({s_len})")
        if len(table) * block_size < s_len:
            raise ValueError(
                f"seq {i}: block table holds {len(table)} blocks x {block_size} tokens, "
                f"fewer than seq_len ({s_len})"
            )


def write_kv(kv_cache: Tensor, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Writes the new tokens' K and V (`[num_tokens, num_heads, head_dim]`) of one layer.

    The per-layer view of the block-major cache is not contiguous, so rows are addressed in
    the flat `[num_blocks * num_layers * 2 * block_size, num_heads, head_dim]` view. On the
    CPU one pass in C copies the rows (`models.cpu_kv_write`).
    """
    if cpu_kv_write.write(kv_cache, layer, k, v, slot_mapping):
        return
    _, num_layers, _, block_size, num_heads, head_dim = kv_cache.shape
    rows = kv_cache.view(-1, num_heads, head_dim)  # [num_rows, num_heads, head_dim]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")  # [num_tokens]
    k_rows = block_ids * (num_layers * 2 * block_size) + (slot_mapping - block_ids * block_size)
    k_rows += layer * 2 * block_size  # [num_tokens]
    rows.index_copy_(0, k_rows, k.to(kv_cache.dtype))
    rows.index_copy_(0, k_rows + block_size, v.to(kv_cache.dtype))


class AttentionBackend(ABC):
    """One attention implementation, chosen once by name (`get_backend`).

    The prefill path is shared; backends differ in how single-token queries read the cache.
    """

    name = ""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, layer: int,
               meta: AttentionMetadata, scale: float) -> Tensor:
        """Writes the new tokens' K/V into the cache (`write_kv`), then attends (`forward`).

        q: `[num_tokens, num_heads, head_dim]`; k, v: `[num_tokens, num_kv_heads,
        head_dim]`; possibly in a wider dtype than the cache (float32 activations over a bf16
        cache): they are then rounded to the cache's dtype and the output widened back.
        Returns `[num_tokens, num_heads, head_dim]` in q's dtype.
        """
        write_kv(kv_cache, layer, k, v, meta.slot_mapping)
        if q.dtype == kv_cache.dtype:
            return self.forward(q, kv_cache, layer, meta, scale, k, v)
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        return self.forward(q.to(kv_cache.dtype), kv_cache, layer, meta, scale, k, v).to(q.dtype)

    def forward(
        self,
        q: Tensor,
        kv_cache: Tensor,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        k: Tensor | None = None,
        v: Tensor | None = None,
    ) -> Tensor:
        """Attends the new tokens' queries over their sequences' KV in the cache.

        Args:
            q: `[num_tokens, num_heads, head_dim]` queries of the new tokens.
            kv_cache: the block-major cache, already holding this step's K/V (`write_kv`).
            layer: which layer of the cache to read.
            meta: the batch description.
            scale: softmax scale (usually head_dim ** -0.5).
            k, v: optional fresh `[num_tokens, num_heads, head_dim]` K/V of the new tokens;
                sequences without a cached prefix then attend over them with no gather.
        Returns:
            `[num_tokens, num_heads, head_dim]` attention output.
        """
        if meta.is_decode:
            return self._grouped_decode(q, kv_cache, layer, _index(meta, kv_cache, None), scale)
        decode_seqs: list[int] = []
        prompts: list[tuple[int, int, int]] = []  # (sequence, first row, query count)
        start = 0
        for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            if q_len == 1 and s_len > 1:
                decode_seqs.append(i)
            else:
                prompts.append((i, start, q_len))
            start += q_len
        out = _prefill(q, kv_cache, layer, meta, scale, k, v, prompts)
        if decode_seqs:
            # NOTE: a mixed batch runs its single-token sequences through the decode kernel.
            index = _index(meta, kv_cache, decode_seqs)
            rows_t = meta.query_start_loc[:-1].index_select(0, index.seq_ids)  # [num_decode]
            out.index_copy_(0, rows_t, self._grouped_decode(q[rows_t], kv_cache, layer, index,
                                                            scale))
        return out

    def _grouped_decode(self, q: Tensor, kv_cache: Tensor, layer: int, index: DecodeIndex,
                        scale: float) -> Tensor:
        """`_decode` for any ratio of query heads to the cache's KV heads. With grouped
        queries (GQA / MQA), the g query heads sharing a KV head become g rows of one
        sequence each, so every decode kernel sees as many query heads as KV heads."""
        num_seqs, num_heads, head_dim = q.shape
        kv_heads = kv_cache.shape[4]
        if num_heads == kv_heads:
            return self._decode(q, kv_cache, layer, index, scale)
        group = num_heads // kv_heads
        rows = q.view(num_seqs, kv_heads, group, head_dim).transpose(1, 2).reshape(
            num_seqs * group, kv_heads, head_dim)  # row s * group + i: heads j * group + i
        out = self._decode(rows, kv_cache, layer, index.grouped(group), scale)
        return out.view(num_seqs, group, kv_heads, head_dim).transpose(1, 2).reshape(
            num_seqs, num_heads, head_dim)

    @abstractmethod
    def _decode(self, q: Tensor, kv_cache: Tensor, layer: int, index: DecodeIndex,
                scale: float) -> Tensor:
        """`[num_seqs, heads, dim]` attention of one query per sequence of `index`."""


class PagedBackend(AttentionBackend):
    """Decode without padding: one pass over exactly the KV each sequence has.

    On the CPU in float32/bf16 that pass is the fused C kernel of `models.cpu_attention`
    when it builds; otherwise (float64, other devices, no compiler) the plain-torch
    reference below: sampled dot products, a segment softmax and a weighted embedding bag.
    """

    name = "paged"

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, layer: int,
               meta: AttentionMetadata, scale: float) -> Tensor:
        """A decode batch runs the fused kernel, which also writes the K/V (no separate
        pass over the cache) and reads each KV head once for its grouped queries; anything
        else, or no kernel, takes the default path."""
        if meta.is_decode:
            index = _index(meta, kv_cache, None)
            out = cpu_attention.decode(q, kv_cache, layer, index.block_tables, index.seq_lens,
                                       index.max_seq_len, scale, new_kv=(k, v))
            if out is not None:
                return out
        return super().attend(q, k, v, kv_cache, layer, meta, scale)

    def _grouped_decode(self, q: Tensor, kv_cache: Tensor, layer: int, index: DecodeIndex,
                        scale: float) -> Tensor:
        """The fused kernel reads each KV head once for its grouped queries (a mixed step's
        decode rows too); the reference path takes the expanded rows."""
        out = cpu_attention.decode(q, kv_cache, layer, index.block_tables, index.seq_lens,
                                   index.max_seq_len, scale)
        return super()._grouped_decode(q, kv_cache, layer, index, scale) if out is None else out

    def _decode(self, q: Tensor, kv_cache: Tensor, layer: int, index: DecodeIndex,
                scale: float) -> Tensor:
        out = cpu_attention.decode(q, kv_cache, layer, index.block_tables, index.seq_lens,
                                   index.max_seq_len, scale)
        return self._decode_reference(q, kv_cache, layer, index, scale) if out is None else out

    def _decode_reference(self, q: Tensor, kv_cache: Tensor, layer: int, index: DecodeIndex,
                          scale: float) -> Tensor:
        """The plain-torch decode (float64 and the fallback of the fused kernel)."""
        num_seqs, num_heads, head_dim = q.shape
        k_rows, v_rows = _layer_rows(kv_cache, layer)  # [num_rows, head_dim] each
        entries = index.entries(kv_cache)
        q_rows = (q * scale).reshape(num_seqs * num_heads, head_dim)  # [segs, head_dim]
        scores = _sample_scores(q_rows, k_rows, entries)  # [nnz]
        p = _segment_softmax(scores, entries).to(v_rows.dtype)  # [nnz]
        out = F.embedding_bag(entries.cols, v_rows, entries.crow[:-1], mode="sum",
                              per_sample_weights=p)  # [segs, head_dim]
        return out.view(num_seqs, num_heads, head_dim)


class PaddedBackend(AttentionBackend):
    """Decode padded to the longest sequence of the batch (the static-batch bubble): every
    sequence reads ``max_seq_len`` KV rows, so a step costs batch x longest."""

    name = "padded"

    def _decode(self, q: Tensor, kv_cache: Tensor, layer: int, index: DecodeIndex,
                scale: float) -> Tensor:
        num_seqs, num_heads, head_dim = q.shape
        block_size = kv_cache.shape[3]
        num_blocks = math.ceil(index.max_seq_len / block_size)
        max_len = num_blocks * block_size
        pad = torch.arange(max_len, device=q.device) >= index.seq_lens[:, None]  # [n, max_len]
        if q.device.type != "cpu":
            tables = index.block_tables[:, :num_blocks]  # [num_seqs, num_blocks]
            k = kv_cache[:, layer, 0][tables].view(num_seqs, max_len, num_heads, head_dim)
            v = kv_cache[:, layer, 1][tables].view(num_seqs, max_len, num_heads, head_dim)
            scores = torch.einsum("nhd,nshd->nhs", q * scale, k)  # [num_seqs, heads, max_len]
            scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
            scores.masked_fill_(pad[:, None, :], float("-inf"))
            p = scores.softmax(-1).to(v.dtype)  # [num_seqs, heads, max_len]
            return torch.einsum("nhs,nshd->nhd", p, v)
        # NOTE: on a CPU, the einsums above copy K and V into a head-major layout and every
        # layer allocates the padded KV afresh: once a layer's padded KV outgrows the
        # processor's cache, those copies and first touches grow a step's time several
        # times faster than its KV. Here both gathers land in one buffer per forward and
        # the products read them in the cache's layout: each query as a block-diagonal row
        # over all heads' KV, which multiplies by the heads but reads the KV once, in order.
        k, v = self._gathered(kv_cache, layer, index, num_blocks)  # [n, max_len, heads*dim]
        eye = torch.eye(num_heads, dtype=q.dtype, device=q.device)
        rows = ((q * scale)[:, :, None, :] * eye[None, :, :, None]).reshape(
            num_seqs, num_heads, num_heads * head_dim)  # row h: query head h in block h
        scores = torch.bmm(rows, k.transpose(1, 2))  # [num_seqs, heads, max_len]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        scores.masked_fill_(pad[:, None, :], float("-inf"))
        p = scores.softmax(-1).to(v.dtype)
        out = torch.bmm(p, v).view(num_seqs, num_heads, num_heads, head_dim)
        return torch.diagonal(out, dim1=1, dim2=2).transpose(1, 2)  # head h of row h

    @staticmethod
    def _gathered(kv_cache: Tensor, layer: int, index: DecodeIndex, num_blocks: int
                  ) -> tuple[Tensor, Tensor]:
        """K and V of ``layer`` for every sequence, padded to ``num_blocks`` blocks:
        ``[num_seqs, num_blocks * block_size, heads * head_dim]`` each, gathered into
        buffers that every layer of the forward reuses (``index.workspace``)."""
        num_seqs = index.block_tables.shape[0]
        block_size, heads, head_dim = kv_cache.shape[3:]
        gather = index.workspace.get("padded")
        if gather is None:  # one index serves one forward: its shapes hold for every layer
            shape = (num_seqs * num_blocks, block_size, heads, head_dim)
            gather = index.workspace["padded"] = (
                index.block_tables[:, :num_blocks].reshape(-1),
                kv_cache.new_empty(shape), kv_cache.new_empty(shape))
        tables, k, v = gather
        torch.index_select(kv_cache[:, layer, 0], 0, tables, out=k)
        torch.index_select(kv_cache[:, layer, 1], 0, tables, out=v)
        width = num_blocks * block_size
        return (k.view(num_seqs, width, heads * head_dim),
                v.view(num_seqs, width, heads * head_dim))


def get_backend(name: str) -> AttentionBackend:
    """Returns a new backend called `name` (registered in models.backends; Triton's are
    imported only then); raises ValueError listing the valid names."""
    return build_backend(name)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class DecodeIndex:
    """The sequences of a decode batch, their KV lengths and block tables, for all layers;
    `entries` adds, built once on first use, where each of their KV rows lives."""

    seq_ids: Tensor  # [num_seqs] long: which sequences of the metadata
    seq_lens: Tensor  # [num_seqs] long
    block_tables: Tensor  # [num_seqs, max_blocks_per_seq] long
    max_seq_len: int
    total_len: int  # sum of seq_lens
    # NOTE: per-forward scratch (the CSR entries, grouped copies); not part of equality.
    workspace: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, meta: AttentionMetadata, kv_cache: Tensor, seq_ids: list[int] | None
              ) -> DecodeIndex:
        device = kv_cache.device
        lens = meta.seq_lens_list if seq_ids is None else [meta.seq_lens_list[i] for i in seq_ids]
        ids = torch.arange(meta.num_seqs, device=device) if seq_ids is None else torch.tensor(
            seq_ids, dtype=torch.long, device=device)  # [num_seqs]
        tables = meta.block_tables if seq_ids is None else meta.block_tables[ids]
        seq_lens = meta.seq_lens if seq_ids is None else meta.seq_lens[ids]  # [num_seqs]
        return cls(ids, seq_lens, tables, max(lens), sum(lens))

    def grouped(self, group: int) -> DecodeIndex:
        """Each sequence `group` times in a row (built once): the index of grouped queries'
        rows (`AttentionBackend._grouped_decode`)."""
        key = f"group{group}"
        index = self.workspace.get(key)
        if index is None:
            index = self.workspace[key] = DecodeIndex(
                self.seq_ids.repeat_interleave(group), self.seq_lens.repeat_interleave(group),
                self.block_tables.repeat_interleave(group, dim=0), self.max_seq_len,
                self.total_len * group)
        return index  # type: ignore[no-any-return]

    def entries(self, kv_cache: Tensor) -> CsrEntries:
        """The CSR entries of this batch in `kv_cache`'s geometry (built once)."""
        csr = self.workspace.get("csr")
        if csr is None:
            csr = self.workspace["csr"] = CsrEntries.build(self, kv_cache)
        return csr


@dataclass(frozen=True, slots=True)
class CsrEntries:
    """Where every (sequence, head, kv position) of a decode batch lives, for all layers.

    Entries are ordered by segment (sequence, head), then position: `crow` points at each
    segment's first entry (CSR rows), `cols` is the entry's row in the layer-0 K view of
    `_layer_rows` (a layer only moves the base of that view).
    """

    cols: Tensor  # [nnz] long, nnz = sum(seq_lens) * num_heads
    crow: Tensor  # [num_seqs * num_heads + 1] long
    seg: Tensor  # [nnz] long, segment of each entry

    @classmethod
    def build(cls, index: DecodeIndex, kv_cache: Tensor) -> CsrEntries:
        _, num_layers, _, block_size, num_heads, _ = kv_cache.shape
        device = kv_cache.device
        seg_lens = index.seq_lens.repeat_interleave(num_heads)  # [segs]
        crow = F.pad(seg_lens.cumsum(0), (1, 0))  # [segs + 1]
        nnz = index.total_len * num_heads
        seg = torch.repeat_interleave(
            torch.arange(seg_lens.shape[0], device=device), seg_lens, output_size=nnz)  # [nnz]
        pos = torch.arange(nnz, device=device) - crow[seg]  # [nnz] kv position in its seq
        seq, head = seg.div(num_heads, rounding_mode="floor"), seg.remainder(num_heads)
        block_ids = index.block_tables[seq, pos.div(block_size, rounding_mode="floor")]  # [nnz]
        cols = (block_ids * (num_layers * 2 * block_size) + pos.remainder(block_size)) * num_heads
        return cls(cols.add_(head), crow, seg)


def _index(meta: AttentionMetadata, kv_cache: Tensor, seq_ids: list[int] | None) -> DecodeIndex:
    """Builds the decode index once per forward; every layer reuses it."""
    key = "decode" if seq_ids is None else "mixed"
    index = meta.workspace.get(key)
    if index is None:
        index = meta.workspace[key] = DecodeIndex.build(meta, kv_cache, seq_ids)
    return index


def _layer_rows(kv_cache: Tensor, layer: int) -> tuple[Tensor, Tensor]:
    """Flat `[num_rows, head_dim]` K and V views whose row r of layer 0 is row r of `layer`."""
    if not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous, got strides {kv_cache.stride()}")
    num_blocks, num_layers, _, block_size, num_heads, head_dim = kv_cache.shape
    head_rows = block_size * num_heads  # rows of one K (or V) block of one layer
    num_rows = (num_blocks - 1) * num_layers * 2 * head_rows + head_rows
    flat = kv_cache.view(-1)
    k_start = layer * 2 * head_rows * head_dim
    v_start = k_start + head_rows * head_dim
    k_rows = flat[k_start:k_start + num_rows * head_dim].view(num_rows, head_dim)
    v_rows = flat[v_start:v_start + num_rows * head_dim].view(num_rows, head_dim)
    return k_rows, v_rows


def _sample_scores(q_rows: Tensor, k_rows: Tensor, index: CsrEntries) -> Tensor:
    """`[nnz]` dot products of each entry's K row with its segment's query row, no gather."""
    if k_rows.dtype in (torch.float32, torch.float64):
        pattern = torch.sparse_csr_tensor(
            index.crow, index.cols, torch.zeros(index.cols.shape, dtype=k_rows.dtype,
                                                device=k_rows.device),
            size=(q_rows.shape[0], k_rows.shape[0]), check_invariants=False)
        return torch.sparse.sampled_addmm(pattern, q_rows, k_rows.t(), beta=0.0).values()
    # NOTE: the backward of embedding_bag's per_sample_weights is exactly this sampled dot
    # product; it also covers bfloat16/float16, which sampled_addmm does not.
    return torch.ops.aten._embedding_bag_per_sample_weights_backward(
        q_rows, k_rows, index.cols, index.crow[:-1], index.seg, 0)


def _segment_softmax(scores: Tensor, index: CsrEntries) -> Tensor:
    """Softmax of `[nnz]` scores within each (sequence, head) segment, in >= float32."""
    s = scores.to(torch.promote_types(scores.dtype, torch.float32))  # [nnz]
    peak = torch.segment_reduce(s, "max", offsets=index.crow)  # [segs]
    s = (s - peak.index_select(0, index.seg)).exp_()
    total = torch.segment_reduce(s, "sum", offsets=index.crow)  # [segs]
    return s.mul_(total.reciprocal_().index_select(0, index.seg))


def _prefill(q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata, scale: float,
             k: Tensor | None, v: Tensor | None, prompts: list[tuple[int, int, int]]) -> Tensor:
    """`[num_tokens, heads, dim]` with the rows of every prompt sequence (`prompts`: its
    index, first row and query count) attended causally over its KV; other rows unset.
    Sequences without a cached prefix attend over the fresh k and v, with no gather."""
    def kv_of(i: int, start: int, q_len: int) -> tuple[Tensor, Tensor]:
        if k is not None and v is not None and q_len == meta.seq_lens_list[i]:
            return k[start:start + q_len], v[start:start + q_len]
        return gather_seq_kv(kv_cache, layer, meta.block_tables[i], meta.seq_lens_list[i])

    seqs = [(start, q_len, meta.seq_lens_list[i], *kv_of(i, start, q_len))
            for i, start, q_len in prompts]
    if seqs and cpu_bf16_attention.takes_prompts(q):
        out = cpu_bf16_attention.prefill(q, seqs, scale)
        if out is not None:
            return out
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [n, heads, dim]
    for start, q_len, s_len, k_seq, v_seq in seqs:
        rows = slice(start, start + q_len)
        out[rows] = _prefill_one(q[rows], q_len, s_len, scale, k_seq, v_seq)
    return out


def _prefill_one(q: Tensor, q_len: int, s_len: int, scale: float, k: Tensor, v: Tensor
                 ) -> Tensor:
    """Causal attention of one sequence's `[q_len, heads, dim]` queries, the last q_len
    positions of its `[s_len, kv_heads, dim]` K and V, by torch's SDPA."""
    mask = None
    if q_len not in (1, s_len):
        # NOTE: bottom-right causal: query j sits at absolute position s_len - q_len + j.
        pos = torch.arange(s_len, device=q.device)  # [s_len]
        mask = pos[None, :] <= pos[s_len - q_len:, None]  # [q_len, s_len]
    # NOTE: batched 4-d inputs: torch's CPU flash-attention kernel takes only those, and
    # 3-d ones run the unfused math path (the full score matrix, in several passes).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=q_len == s_len and q_len > 1, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # [1, num_heads, q_len, head_dim]
    return out[0].transpose(0, 1)


def gather_seq_kv(kv_cache: Tensor, layer: int, block_table: Tensor, seq_len: int
                  ) -> tuple[Tensor, Tensor]:
    """Copies one sequence's K and V (`[seq_len, num_heads, head_dim]` each) out of the cache."""
    block_size, num_heads, head_dim = kv_cache.shape[3:]
    num_blocks = math.ceil(seq_len / block_size)
    kv = kv_cache[block_table[:num_blocks], layer]  # [num_blocks, 2, block_size, heads, dim]
    k = kv[:, 0].reshape(-1, num_heads, head_dim)[:seq_len]  # [seq_len, num_heads, head_dim]
    v = kv[:, 1].reshape(-1, num_heads, head_dim)[:seq_len]
    return k, v
