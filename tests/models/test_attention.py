"""Attention tests: metadata, KV writes, and both backends against a dense float64 oracle."""

from __future__ import annotations

import random

import pytest
import torch

from models import cpu_attention
from models.attention import BACKEND_NAMES, AttentionMetadata, get_backend, write_kv
from tests.models.conftest import dense_reference, make_block_tables, make_kv_cache, rel_err

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 4, 32  # HEAD_DIM: both kernel widths run
SCALE = HEAD_DIM ** -0.5
LANES = [cpu_attention.LANES, cpu_attention.WIDE_LANES]  # both builds run on any x86 CPU


def decode_batch(lens: list[int], dtype: torch.dtype, block_size: int, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    tables, num_blocks = make_block_tables(lens, block_size, seed)
    kv_cache = make_kv_cache(num_blocks, NUM_LAYERS, NUM_HEADS, HEAD_DIM, dtype, block_size)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size, "cpu")
    q = torch.randn(len(lens), NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    return q.to(dtype), kv_cache, meta


def random_lens(seed: int, block_size: int) -> list[int]:
    rng = random.Random(seed)
    lens = [rng.randint(1, 2000) for _ in range(10)]
    return lens + [1, block_size, 3 * block_size, 2000 // block_size * block_size, 2000]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_matches_dense_reference(backend: str, block_size: int, seed: int) -> None:
    q, kv_cache, meta = decode_batch(random_lens(seed, block_size), torch.float64, block_size,
                                     seed)
    out = get_backend(backend).forward(q, kv_cache, 1, meta, SCALE)
    assert out.shape == q.shape
    assert rel_err(out, dense_reference(q, kv_cache, 1, meta, SCALE)) < 1e-6


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize(("dtype", "tolerance"), [
    (torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_decode_in_lower_precision_stays_close(backend: str, dtype: torch.dtype,
                                               tolerance: float) -> None:
    q, kv_cache, meta = decode_batch([5, 300, 64, 1, 999], dtype, 16)
    out = get_backend(backend).forward(q, kv_cache, 0, meta, SCALE)
    assert out.dtype == dtype
    assert rel_err(out, dense_reference(q, kv_cache, 0, meta, SCALE)) < tolerance


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_prefill_chunk_and_decode_in_one_batch_match_reference(backend: str) -> None:
    query_lens, seq_lens = [1, 4, 30, 1, 7], [1, 10, 30, 77, 7]
    tables, num_blocks = make_block_tables(seq_lens)
    kv_cache = make_kv_cache(num_blocks, NUM_LAYERS, NUM_HEADS, HEAD_DIM, torch.float64)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 4, "cpu")
    q, k, v = torch.randn(3, sum(query_lens), NUM_HEADS, HEAD_DIM, dtype=torch.float64)
    write_kv(kv_cache, 1, k, v, meta.slot_mapping)
    want = dense_reference(q, kv_cache, 1, meta, SCALE)
    fresh = get_backend(backend).forward(q, kv_cache, 1, meta, SCALE, k, v)
    from_cache = get_backend(backend).forward(q, kv_cache, 1, meta, SCALE)
    assert rel_err(fresh, want) < 1e-12
    assert rel_err(from_cache, want) < 1e-12


def test_write_kv_fills_exactly_the_mapped_slots() -> None:
    kv_cache = torch.zeros(6, NUM_LAYERS, 2, 4, NUM_HEADS, HEAD_DIM)
    meta = AttentionMetadata.build([3, 2], [5, 2], [[4, 2], [5]], 4, "cpu")
    k, v = torch.randn(2, 5, NUM_HEADS, HEAD_DIM)
    write_kv(kv_cache, 1, k, v, meta.slot_mapping)
    # seq 0 positions 2, 3, 4 -> block 4 offsets 2, 3 and block 2 offset 0; seq 1 -> block 5
    where = [(4, 2), (4, 3), (2, 0), (5, 0), (5, 1)]
    for row, (block, offset) in enumerate(where):
        assert torch.equal(kv_cache[block, 1, 0, offset], k[row])
        assert torch.equal(kv_cache[block, 1, 1, offset], v[row])
    assert int((kv_cache != 0).any(-1).any(-1).sum()) == 2 * len(where)


def test_metadata_build_derives_slots_and_padding() -> None:
    meta = AttentionMetadata.build([3, 1], [5, 9], [[4, 2], [7, 1, 3]], 4, "cpu")
    assert meta.slot_mapping.tolist() == [4 * 4 + 2, 4 * 4 + 3, 2 * 4 + 0, 3 * 4 + 0]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.block_tables.tolist() == [[4, 2, 0], [7, 1, 3]]
    assert not meta.is_decode
    assert AttentionMetadata.build([1, 1], [5, 9], [[4, 2], [7, 1, 3]], 4, "cpu").is_decode


@pytest.mark.parametrize(("query_lens", "seq_lens", "tables", "message"), [
    ([1], [9], [[1, 2]], r"block table holds 2 blocks x 4 tokens, fewer than seq_len \(9\)"),
    ([6], [5], [[1, 2]], r"query_len \(6\) must be in 1..seq_len \(5\)"),
    ([1, 1], [5], [[1, 2]], r"query_lens \(2\), seq_lens \(1\)"),
])
def test_metadata_build_rejects_inconsistent_input(query_lens: list[int], seq_lens: list[int],
                                                   tables: list[list[int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(query_lens, seq_lens, tables, 4, "cpu")


def test_unknown_backend_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="'flash'.*paged, padded"):
        get_backend("flash")


def test_paged_decode_rejects_non_contiguous_cache() -> None:
    q, kv_cache, meta = decode_batch([3, 5], torch.float32, 4)
    strided = kv_cache.transpose(4, 5).contiguous().transpose(4, 5)
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        get_backend("paged").forward(q, strided, 0, meta, SCALE)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_seqs", [3, 40])  # one head per work item; whole sequences
@pytest.mark.parametrize("lanes", LANES)
def test_cpu_kernel_matches_reference(dtype: torch.dtype, tolerance: float,
                                      num_seqs: int, lanes: int) -> None:
    lens = [random.Random(num_seqs).randint(1, 700) for _ in range(num_seqs)] + [1, 16, 17]
    q, kv_cache, meta = decode_batch(lens, dtype, 16, seed=num_seqs)
    if not cpu_attention.is_supported(kv_cache):
        pytest.skip("no C compiler for the CPU kernel")
    kernel = cpu_attention.decode(q, kv_cache, 1, meta.block_tables, meta.seq_lens, max(lens),
                                  SCALE, lanes=lanes)
    assert kernel is not None and kernel.dtype == dtype
    assert rel_err(kernel, dense_reference(q, kv_cache, 1, meta, SCALE)) < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_reference_path_without_the_kernel(dtype: torch.dtype,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_attention, "is_supported", lambda kv_cache: False)
    q, kv_cache, meta = decode_batch([5, 300, 64, 1, 999], dtype, 16)
    out = get_backend("paged").forward(q, kv_cache, 0, meta, SCALE)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(out, dense_reference(q, kv_cache, 0, meta, SCALE)) < tolerance


@pytest.mark.parametrize(("q_dtype", "cache_dtype", "tolerance"), [
    (torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 2e-2),
    (torch.float32, torch.bfloat16, 2e-2)])  # the last: float32 activations, bf16 cache
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("num_seqs", [3, 40])  # one head per work item; whole sequences
@pytest.mark.parametrize(("kv_heads", "lanes"), [(NUM_HEADS, LANES[0]), (NUM_HEADS, LANES[1]),
                                                 (2, LANES[0]), (1, LANES[1])])
def test_cpu_kernel_writes_this_steps_kv_like_write_kv(
        q_dtype: torch.dtype, cache_dtype: torch.dtype, tolerance: float, block_size: int,
        num_seqs: int, kv_heads: int, lanes: int) -> None:
    """Also with grouped queries (NUM_HEADS query heads over kv_heads KV heads)."""
    rng = random.Random(block_size * 100 + num_seqs)
    # NOTE: lengths on and just past block boundaries: the new token opens a block
    lens = [rng.randint(1, 300) for _ in range(num_seqs)] + [1, block_size, block_size + 1]
    tables, num_blocks = make_block_tables(lens, block_size, seed=num_seqs)
    kv_cache = make_kv_cache(num_blocks, NUM_LAYERS, kv_heads, HEAD_DIM, cache_dtype,
                             block_size)
    if not cpu_attention.is_supported(kv_cache):
        pytest.skip("no C compiler for the CPU kernel")
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size, "cpu")
    # q, k, v as the model makes them: strided views of one fused projection
    qkv = torch.randn(len(lens), NUM_HEADS + 2 * kv_heads, HEAD_DIM,
                      generator=torch.Generator().manual_seed(7)).to(q_dtype)
    q, k, v = qkv.split([NUM_HEADS, kv_heads, kv_heads], dim=1)
    want_cache = kv_cache.clone()
    write_kv(want_cache, 1, k, v, meta.slot_mapping)
    out = cpu_attention.decode(q, kv_cache, 1, meta.block_tables, meta.seq_lens, max(lens),
                               SCALE, new_kv=(k, v), lanes=lanes)
    assert out is not None and out.dtype == q_dtype
    assert torch.equal(kv_cache, want_cache)  # the same slots, rounded the same, nothing else
    assert rel_err(out, dense_reference(q, want_cache, 1, meta, SCALE)) < tolerance


@pytest.mark.parametrize("kernel", [True, False])
def test_attend_over_a_narrower_cache_matches_the_cache_dtype_path(
        kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 queries over a bf16 cache (prefill, chunk and decode rows in one batch, and
    a decode batch), with and without the kernel: the cache gets what write_kv writes and
    the output is close to attention over that cache."""
    if not kernel:
        monkeypatch.setattr(cpu_attention, "is_supported", lambda kv_cache: False)
    for query_lens, seq_lens in (([1, 4, 30, 1, 7], [1, 10, 30, 77, 7]), ([1] * 5, [9, 1, 40,
                                                                                    17, 3])):
        tables, num_blocks = make_block_tables(seq_lens)
        kv_cache = make_kv_cache(num_blocks, NUM_LAYERS, NUM_HEADS, HEAD_DIM, torch.bfloat16)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, 4, "cpu")
        q, k, v = torch.randn(3, sum(query_lens), NUM_HEADS, HEAD_DIM)
        want_cache = kv_cache.clone()
        write_kv(want_cache, 1, k, v, meta.slot_mapping)
        out = get_backend("paged").attend(q, k, v, kv_cache, 1, meta, SCALE)
        assert out.dtype == torch.float32
        assert torch.equal(kv_cache, want_cache)
        assert rel_err(out, dense_reference(q, want_cache, 1, meta, SCALE)) < 2e-2


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize(("kv_heads", "heads"), [(2, 6), (2, 8), (1, 8), (1, 3)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grouped_query_heads_read_their_kv_head(backend: str, kv_heads: int, heads: int,
                                                dtype: torch.dtype) -> None:
    """GQA / MQA: a cache of `kv_heads` heads; decode, prefill and mixed steps match the
    oracle, which repeats each KV head for its group of query heads."""
    lens, query_lens = [1, 9, 40, 200, 333], [1, 9, 1, 5, 1]
    tables, num_blocks = make_block_tables(lens, 4)
    kv_cache = make_kv_cache(num_blocks, NUM_LAYERS, kv_heads, HEAD_DIM, dtype, 4)
    g = torch.Generator().manual_seed(heads)
    for q_lens in ([1] * len(lens), query_lens):
        meta = AttentionMetadata.build(q_lens, lens, tables, 4, "cpu")
        q = torch.randn(sum(q_lens), heads, HEAD_DIM, generator=g).to(dtype)
        k, v = (torch.randn(sum(q_lens), kv_heads, HEAD_DIM, generator=g).to(dtype)
                for _ in range(2))
        out = get_backend(backend).attend(q, k, v, kv_cache, 1, meta, SCALE)
        assert out.shape == q.shape
        ref = dense_reference(q, kv_cache, 1, meta, SCALE)
        assert rel_err(out.double(), ref) < (1e-12 if dtype == torch.float64 else 1e-5)
