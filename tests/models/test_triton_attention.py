"""Triton decode kernels against the `paged` reference, on the CPU, in Triton's interpreter.

Triton picks interpreter or compiler when it is first imported (`TRITON_INTERPRET=1`), so the
kernels run once per session in a subprocess that reports its errors; the tests assert on them.
The fallback rules and the split plan are checked in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.attention import AttentionMetadata, get_backend
from models.triton_attention import (
    MAX_CHUNKS,
    MIN_CHUNK_TOKENS,
    TILE_TOKENS,
    _decode_kernel,
    _merge_kernel,
    _split_kernel,
    split_plan,
)
from tests.models.conftest import dense_reference, make_block_tables, make_kv_cache, rel_err

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_HEADS = 2
SCALE = 0.125
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOLERANCES = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 2e-2}  # rel. to the fp32 reference
# Lengths of 1, on block / tile / split-chunk boundaries (and one past), and random ones.
BOUNDARY_LENS = [1, 16, 17, TILE_TOKENS, MIN_CHUNK_TOKENS, MIN_CHUNK_TOKENS + 1,
                 2 * MIN_CHUNK_TOKENS]
CASES = {  # case id -> (dtype, block_size, head_dim, seed)
    "float32-bs16-d64": ("float32", 16, 64, 0),
    "float32-bs12-d80": ("float32", 12, 80, 1),  # head_dim and block size not powers of two
    "float16-bs16-d64": ("float16", 16, 64, 2),
    "bfloat16-bs32-d32": ("bfloat16", 32, 32, 3),
}
BACKENDS = ("triton", "triton-lpt", "triton-splitk")
GQA_HEADS = ((2, 6), (1, 4))  # (KV heads, query heads): grouped-query and multi-query


def case_inputs(dtype: str, block_size: int, head_dim: int, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode batch with boundary and random lengths; `q` is a strided view, as in OPT."""
    g = torch.Generator().manual_seed(seed)
    lens = BOUNDARY_LENS + torch.randint(1, 700, (3,), generator=g).tolist()
    tables, num_blocks = make_block_tables(lens, block_size, seed)
    kv_cache = make_kv_cache(num_blocks, 2, NUM_HEADS, head_dim, DTYPES[dtype], block_size)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size, "cpu")
    qkv = torch.randn(len(lens), 3, NUM_HEADS, head_dim, generator=g).to(DTYPES[dtype])
    return qkv[:, 0], kv_cache, meta  # q: [num_seqs, num_heads, head_dim], not contiguous


def interpreter_results() -> dict[str, object]:
    """Runs in the interpreter subprocess: each (backend, case)'s error against `paged` in
    fp32 on the same (upcast) values, plus the output dtype and shape."""
    from models.triton_attention import IS_INTERPRETED

    results: dict[str, object] = {"is_interpreted": IS_INTERPRETED}
    for case, (dtype, block_size, head_dim, seed) in CASES.items():
        q, kv_cache, meta = case_inputs(dtype, block_size, head_dim, seed)
        ref = get_backend("paged").forward(q.float(), kv_cache.float(), 1, meta, SCALE)
        outs = {name: get_backend(name).forward(q, kv_cache, 1, meta, SCALE)
                for name in BACKENDS}
        for name, out in outs.items():
            results[f"{name}/{case}"] = {"err": rel_err(out.float(), ref), "dtype": str(out.dtype),
                                         "shape": list(out.shape)}
        # Longest-first changes which program runs when, never what one computes.
        results[f"lpt-equal/{case}"] = torch.equal(outs["triton-lpt"], outs["triton"])
    for kv_heads, heads in GQA_HEADS:
        q, kv_cache, meta = gqa_inputs(kv_heads, heads)
        ref = dense_reference(q, kv_cache, 1, meta, SCALE)
        for name in BACKENDS:
            out = get_backend(name).forward(q, kv_cache, 1, meta, SCALE)
            results[f"{name}/gqa{heads}x{kv_heads}"] = rel_err(out.double(), ref)
    return results


def gqa_inputs(kv_heads: int, heads: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A float32 decode batch whose queries have `heads` heads over `kv_heads` KV heads."""
    lens = [1, 17, MIN_CHUNK_TOKENS + 1, 300]
    tables, num_blocks = make_block_tables(lens, 16)
    kv_cache = make_kv_cache(num_blocks, 2, kv_heads, 32, block_size=16)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, 16, "cpu")
    q = torch.randn(len(lens), heads, 32, generator=torch.Generator().manual_seed(heads))
    return q, kv_cache, meta


@pytest.fixture(scope="module")
def interpreted() -> dict[str, object]:
    code = ("import json; from tests.models.test_triton_attention import interpreter_results; "
            "print(json.dumps(interpreter_results()))")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_subprocess_runs_the_kernels_in_the_interpreter(interpreted: dict[str, object]) -> None:
    assert interpreted["is_interpreted"] is True


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_matches_paged_reference(interpreted: dict[str, object], backend: str,
                                        case: str) -> None:
    result = interpreted[f"{backend}/{case}"]
    assert isinstance(result, dict)
    dtype, _, head_dim, _ = CASES[case]
    assert result["dtype"] == str(DTYPES[dtype])
    assert result["shape"] == [len(BOUNDARY_LENS) + 3, NUM_HEADS, head_dim]
    assert result["err"] < TOLERANCES[dtype]


@pytest.mark.parametrize("heads", GQA_HEADS, ids=lambda h: f"{h[1]}q-{h[0]}kv")
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_reads_each_query_heads_kv_head(interpreted: dict[str, object], backend: str,
                                               heads: tuple[int, int]) -> None:
    """Grouped queries: query head h attends KV head h // (heads / kv_heads)."""
    err = interpreted[f"{backend}/gqa{heads[1]}x{heads[0]}"]
    assert isinstance(err, float) and err < 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_longest_first_order_gives_the_batch_order_bits(interpreted: dict[str, object],
                                                        case: str) -> None:
    """Outputs land in batch order (each program writes its own sequence's row)."""
    assert interpreted[f"lpt-equal/{case}"] is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_tensors_without_interpreter_take_the_paged_path(backend: str) -> None:
    q, kv_cache, meta = case_inputs("float32", 16, 64, 0)
    out = get_backend(backend).forward(q, kv_cache, 0, meta, SCALE)
    assert torch.equal(out, get_backend("paged").forward(q, kv_cache, 0, meta, SCALE))


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_and_mixed_steps_take_the_paged_path(backend: str) -> None:
    query_lens, seq_lens = [1, 5, 9], [40, 5, 20]
    tables, num_blocks = make_block_tables(seq_lens, 16)
    kv_cache = make_kv_cache(num_blocks, 1, NUM_HEADS, 16, block_size=16)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 16, "cpu")
    q = torch.randn(sum(query_lens), NUM_HEADS, 16)
    out = get_backend(backend).forward(q, kv_cache, 0, meta, SCALE)
    assert torch.equal(out, get_backend("paged").forward(q, kv_cache, 0, meta, SCALE))


@pytest.mark.parametrize("max_tokens", [1, 63, 64, 256, 257, 2048, 8192, 8193, 100_000])
def test_split_plan_covers_every_position_in_bounded_chunks(max_tokens: int) -> None:
    chunk, num_chunks = split_plan(max_tokens)
    assert chunk % TILE_TOKENS == 0 and chunk >= MIN_CHUNK_TOKENS
    assert 1 <= num_chunks <= MAX_CHUNKS
    assert (num_chunks - 1) * chunk < max_tokens <= num_chunks * chunk


def test_split_plan_rejects_an_empty_range() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        split_plan(0)


ARG_TYPES = {  # kernel argument -> Triton type, as a launch on fp16 tensors specialises them
    "out_ptr": "*fp16", "q_ptr": "*fp16", "kv_ptr": "*fp16", "tables_ptr": "*i64",
    "seq_lens_ptr": "*i64", "order_ptr": "*i64", "part_acc_ptr": "*fp32",
    "part_ml_ptr": "*fp32", "scale": "fp32",
    "stride_block": "i64", **{name: "i32" for name in (
        "stride_qs", "stride_qh", "stride_os", "stride_oh", "stride_table", "layer_offset",
        "v_offset", "stride_token", "chunk_tokens", "num_chunks")},
}


@pytest.mark.parametrize(("kernel", "constants"), [
    (_decode_kernel, dict(HEAD_DIM=80, BLOCK_D=128, BLOCK_SIZE=16, TILE=TILE_TOKENS,
                          NUM_HEADS=40, LPT=False, GROUP=1)),
    (_decode_kernel, dict(HEAD_DIM=80, BLOCK_D=128, BLOCK_SIZE=16, TILE=TILE_TOKENS,
                          NUM_HEADS=40, LPT=True, GROUP=5)),  # grouped-query heads
    (_split_kernel, dict(HEAD_DIM=80, BLOCK_D=128, BLOCK_SIZE=16, TILE=TILE_TOKENS,
                         GROUP=4)),
    (_merge_kernel, dict(HEAD_DIM=80, BLOCK_D=128, CHUNKS_P2=MAX_CHUNKS)),
], ids=["decode", "decode-lpt", "split", "merge"])
def test_kernel_compiles_for_hopper_without_a_gpu(kernel: object, constants: dict[str, int]
                                                  ) -> None:
    """The interpreter accepts code the compiler rejects; compile ahead of time for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names  # type: ignore[attr-defined]
    signature = {n: "constexpr" if n in constants else ARG_TYPES[n] for n in names}
    compiled = triton.compile(ASTSource(kernel, signature, constants),
                              target=GPUTarget("cuda", 90, 32))
    assert ".entry" in compiled.asm["ptx"]
