"""The bf16 attention kernels (`models.cpu_bf16_attention`, `models.cpu_mha_decode`): prompt
attention as accurate as torch's own bf16 attention against a float64 reference, decode
within bf16 rounding of it, on every shape the models use, and each used where the CPU has a
native bf16 dot product."""

import dataclasses
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from models import cpu_bf16_attention, cpu_isa, cpu_mha_decode
from models.attention import AttentionMetadata, get_backend, write_kv
from tests.models.conftest import dense_reference, make_block_tables, make_kv_cache

pytestmark = pytest.mark.skipif(
    not cpu_bf16_attention.is_supported(torch.empty(1, 1, 32, dtype=torch.bfloat16)),
    reason="needs a CPU with AVX-512 BF16 (or AMX) and a C compiler")

SCALE = 0.125


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
              ) -> torch.Tensor:
    """Bottom-right causal attention of `[q_len, heads, dim]` over `[s_len, kv_heads, dim]`."""
    q_len, s_len, rep = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).to(dtype), v.repeat_interleave(rep, 1).to(dtype)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), k) * SCALE
    pos = torch.arange(s_len)
    scores.masked_fill_(pos[None, :] > pos[s_len - q_len:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def torch_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    q_len, s_len = q.shape[0], k.shape[0]
    pos = torch.arange(s_len)
    mask = pos[None, :] <= pos[s_len - q_len:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=SCALE, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (12, 12, 64), (4, 1, 32),
                                                        (4, 2, 128), (6, 2, 96)])
@pytest.mark.parametrize("tiles", [True, False])  # cpu_bf16_attention.TILES (where AMX)
def test_matches_float64_as_closely_as_torch_bf16(heads: int, kv_heads: int, dim: int,
                                                  tiles: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Several prompts in one call, q/k/v strided views of one fused projection, some with a
    cached prefix (their queries the last positions): every row within torch's own bf16
    error of the float64 answer."""
    monkeypatch.setattr(cpu_bf16_attention, "TILES", tiles)
    torch.manual_seed(heads * dim)
    shapes = [(1, 1), (37, 37), (200, 200), (70, 135), (1, 64), (130, 130)]  # (queries, keys)
    seqs, queries, start = [], [], 0
    for q_len, s_len in shapes:
        qkv = torch.randn(s_len, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
        q = qkv[s_len - q_len:, :heads * dim].view(q_len, heads, dim)
        k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(s_len, kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim:].view(s_len, kv_heads, dim)
        seqs.append((start, q_len, s_len, k, v))
        queries.append(q)
        start += q_len
    out = cpu_bf16_attention.prefill(torch.cat(queries), seqs, SCALE)
    assert out is not None and out.dtype == torch.bfloat16
    for q, (start, q_len, _, k, v) in zip(queries, seqs):
        want = reference(q, k, v, torch.float64)
        ours = (out[start:start + q_len].double() - want).abs()
        theirs = (torch_bf16(q, k, v).double() - want).abs()
        assert ours.mean() <= 1.1 * theirs.mean() + 1e-4
        assert ours.max() <= 1.5 * theirs.max() + 1e-3


def test_unsupported_inputs_fall_back() -> None:
    """float32 queries, or a head_dim the kernel does not tile, return None (the caller
    keeps torch's path)."""
    k = v = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    assert cpu_bf16_attention.prefill(torch.randn(8, 4, 64), [(0, 8, 8, k, v)], SCALE) is None
    k16 = v16 = torch.randn(8, 2, 16, dtype=torch.bfloat16)
    q16 = torch.randn(8, 4, 16, dtype=torch.bfloat16)
    assert cpu_bf16_attention.prefill(q16, [(0, 8, 8, k16, v16)], SCALE) is None


@pytest.mark.parametrize(("level", "tiles", "takes"), [
    ("AVX-512-bf16", True, True), ("AVX-512-bf16", False, True), ("AMX", True, True),
    ("AMX", False, False)])
def test_prompts_go_to_the_kernel_where_it_beats_torchs_sdpa(
        level: str, tiles: bool, takes: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX, torch's flash attention runs its GEMMs on the tile units: prompts go to
    the kernel there only with its own tile products; with AVX-512 BF16 alone, always."""
    isa = cpu_isa.detect()
    monkeypatch.setattr(cpu_isa, "detect", lambda: dataclasses.replace(isa, level=level))
    monkeypatch.setattr(cpu_bf16_attention, "TILES", tiles)
    assert cpu_bf16_attention.takes_prompts(torch.empty(4, 2, 64, dtype=torch.bfloat16)) is takes
    assert not cpu_bf16_attention.takes_prompts(torch.empty(4, 2, 64))  # float32: never


@pytest.mark.parametrize("backend", ["paged", "padded"])
def test_backends_use_it_for_bf16_prompts(backend: str, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """A mixed bf16 step (fresh prompts, a chunk over a cached prefix, decode rows) goes
    through the kernel once per layer, and matches attention over the cache (on a CPU whose
    prompts it takes, as it would on any other)."""
    monkeypatch.setattr(cpu_bf16_attention, "PROMPT_LEVELS", (cpu_isa.detect().level,))
    calls = []
    real = cpu_bf16_attention.prefill

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_bf16_attention, "prefill", counted)
    torch.manual_seed(0)
    query_lens, seq_lens = [1, 40, 30, 1, 7], [1, 90, 30, 77, 7]
    tables, num_blocks = make_block_tables(seq_lens)
    kv_cache = make_kv_cache(num_blocks, 2, 2, 64, torch.bfloat16)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 4, "cpu")
    q = torch.randn(sum(query_lens), 6, 64).to(torch.bfloat16)
    k, v = torch.randn(2, sum(query_lens), 2, 64).to(torch.bfloat16)
    out = get_backend(backend).attend(q, k, v, kv_cache, 1, meta, SCALE)
    want_cache = kv_cache.clone()
    write_kv(want_cache, 1, k, v, meta.slot_mapping)
    want = dense_reference(q, want_cache, 1, meta, SCALE)
    assert len(calls) == 1
    assert (out.double() - want).abs().max() < 3e-2



DECODE_CASES = [  # kernel, heads, KV heads, head_dim, block size, cpu_bf16_attention.TILES
    *((cpu_bf16_attention, *shape, 4, tiles) for shape in [(9, 3, 64), (12, 12, 64), (4, 1, 32),
                                                           (4, 2, 128)]
      for tiles in (True, False)),
    # whole 16-key tiles per block: q.k (and p.v at head_dim 64) on AMX tiles where the CPU
    # has them (up to 16 query heads per KV head; 17 take the vector path), and the vector
    # path with the tiles off
    *((cpu_bf16_attention, *shape, tiles) for shape in [(9, 3, 64, 16), (8, 1, 128, 32),
                                                        (32, 2, 64, 16), (17, 1, 32, 16),
                                                        (8, 2, 64, 32)]
      for tiles in (True, False)),
    # block sizes that split its 16-position tiles, every head_dim it has a kernel for (no
    # tile path)
    *((cpu_mha_decode, *shape, True) for shape in [(12, 12, 64, 16), (4, 4, 32, 5),
                                                   (2, 2, 128, 4), (3, 3, 96, 16)])]


@pytest.mark.parametrize(("kernel", "heads", "kv_heads", "dim", "block_size", "tiles"),
                         DECODE_CASES)
@pytest.mark.parametrize("num_seqs", [3, 20])  # one KV head per work item; whole sequences
def test_decode_matches_float64_and_writes_the_new_kv(kernel: ModuleType, heads: int,
                                                      kv_heads: int, dim: int, block_size: int,
                                                      tiles: bool, num_seqs: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One query per sequence over lengths that end inside, at and just past a block and a
    16-position tile: within bf16 rounding of the float64 answer, and this step's K/V land
    in the cache exactly as write_kv puts them. The slots past each sequence's end hold NaN
    (a block's unwritten rows are whatever memory held): no answer may depend on them."""
    monkeypatch.setattr(cpu_bf16_attention, "TILES", tiles)
    torch.manual_seed(num_seqs * dim + block_size)
    lens = [(1, 15, 16, 17, 32, 33, 150)[i % 7] + i // 7 for i in range(num_seqs)]
    tables, num_blocks = make_block_tables(lens, block_size)
    kv_cache = make_kv_cache(num_blocks, 2, kv_heads, dim, torch.bfloat16, block_size)
    q = torch.randn(num_seqs, heads, dim).to(torch.bfloat16)
    k_new, v_new = torch.randn(2, num_seqs, kv_heads, dim).to(torch.bfloat16)
    meta = AttentionMetadata.build([1] * num_seqs, lens, tables, block_size, "cpu")
    for i, n in enumerate(lens):
        last = int(meta.block_tables[i][(n - 1) // block_size])
        kv_cache[last, :, :, (n - 1) % block_size + 1:] = float("nan")
    want_cache = kv_cache.clone()
    write_kv(want_cache, 1, k_new, v_new, meta.slot_mapping)
    out = kernel.decode(q, kv_cache, 1, meta.block_tables, meta.seq_lens, max(lens), SCALE,
                        (k_new, v_new))
    assert out is not None and out.dtype == torch.bfloat16
    assert torch.equal(kv_cache.view(torch.int16), want_cache.view(torch.int16))  # NaN bits too
    want = dense_reference(q.double(), want_cache, 1, meta, SCALE)
    err = (out.double() - want).abs()
    assert err.max() < 2e-2 and err.mean() < 2e-3


def test_mha_decode_takes_strided_queries_and_declines_the_rest() -> None:
    """`cpu_mha_decode.decode` takes queries that are a view of a fused QKV projection, and
    declines (None) grouped queries, float32 queries and head dims it has no kernel for, so
    that the caller takes another kernel."""
    lens = [9, 40]
    tables, num_blocks = make_block_tables(lens, 16)
    meta = AttentionMetadata.build([1, 1], lens, tables, 16, "cpu")
    kv_cache = make_kv_cache(num_blocks, 1, 4, 64, torch.bfloat16, 16)
    qkv = torch.randn(2, 3, 4, 64).to(torch.bfloat16)
    args = (kv_cache, 0, meta.block_tables, meta.seq_lens, 40, SCALE)
    out = cpu_mha_decode.decode(qkv[:, 0], *args)
    want = dense_reference(qkv[:, 0].double(), kv_cache, 0, meta, SCALE)
    assert out is not None and (out.double() - want).abs().max() < 2e-2
    assert cpu_mha_decode.decode(torch.randn(2, 8, 64).bfloat16(), *args) is None
    assert cpu_mha_decode.decode(torch.randn(2, 4, 64), *args) is None
    wide = make_kv_cache(num_blocks, 1, 4, 256, torch.bfloat16, 16)
    assert cpu_mha_decode.decode(torch.randn(2, 4, 256).bfloat16(), wide, *args[1:]) is None


def test_bf16_decode_takes_the_bf16_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cpu_attention.decode` hands grouped bf16 queries to this kernel, and one query head
    per KV head to `models.cpu_mha_decode`."""
    from models import cpu_attention
    calls = []
    for module in (cpu_bf16_attention, cpu_mha_decode):
        def counted(*args, real=module.decode, name=module.__name__):  # type: ignore[no-untyped-def]
            calls.append((name, args[0].shape[1]))
            return real(*args)

        monkeypatch.setattr(module, "decode", counted)
    lens = [5, 40]
    tables, num_blocks = make_block_tables(lens, 4)
    meta = AttentionMetadata.build([1, 1], lens, tables, 4, "cpu")
    for heads in (6, 2):
        kv_cache = make_kv_cache(num_blocks, 1, 2, 64, torch.bfloat16, 4)
        q = torch.randn(2, heads, 64).to(torch.bfloat16)
        out = cpu_attention.decode(q, kv_cache, 0, meta.block_tables, meta.seq_lens, 40, SCALE)
        want = dense_reference(q.double(), kv_cache, 0, meta, SCALE)
        assert out is not None and (out.double() - want).abs().max() < 2e-2
    assert calls == [("models.cpu_bf16_attention", 6), ("models.cpu_mha_decode", 2)]
