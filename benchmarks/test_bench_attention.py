"""Benchmarks: decode attention per backend on uniform vs skewed batches, a full
opt-125m decode step beside its roofline floor measured in the same run, and each float32
GEMM at the step's linear shapes. Prints tables.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from aserve.engine.host import tune_host_allocator
from bench.metrics import median_range
from models import cpu_attention, cpu_bf16_attention, cpu_gemm, cpu_isa
from models.attention import BACKEND_NAMES, AttentionMetadata, get_backend
from models.cpu_kernels import advise_huge_pages
from models.loader import build_preset
from models.opt import OPTForCausalLM, fit_matmuls_to, has_half_matmul

pytestmark = pytest.mark.bench

BLOCK_SIZE = 16  # tokens per KV block
NUM_HEADS, HEAD_DIM = 12, 64  # opt-125m head geometry
CONTEXT = 128  # cached tokens per sequence before the timed decode step
REPEATS = 7
ROUNDS = 9  # (floor sample, step) pairs per row of the roofline table
BATCHES = {  # name -> KV lengths; the first two hold 40448 KV tokens each
    "uniform 64x632": [632] * 64,
    "skewed 60x400+4x4112 (same total)": [400] * 60 + [4112] * 4,
    "skewed 60x632+4x4696 (1.40x total)": [632] * 60 + [4696] * 4,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float

    def __str__(self) -> str:
        return f"{self.median_ms:9.2f} [{self.min_ms:.2f}-{self.max_ms:.2f}]"


def measure(fn: Callable[[], object], repeats: int = REPEATS, warm_up: bool = True) -> Timing:
    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return Timing(statistics.median(times), min(times), max(times))


def paged_inputs(lens: list[int], num_layers: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, list[list[int]]]:
    """A KV cache with every sequence's blocks, in shuffled block order, and its tables."""
    counts = [-(-n // BLOCK_SIZE) for n in lens]
    ids = (torch.randperm(sum(counts), generator=torch.Generator().manual_seed(0)) + 1).tolist()
    tables, start = [], 0
    for count in counts:
        tables.append(ids[start:start + count])
        start += count
    shape = (sum(counts) + 1, num_layers, 2, BLOCK_SIZE, num_heads, head_dim)
    return on_huge_pages(torch.randn(shape, dtype=dtype)), tables


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in fresh memory advised for huge pages, as the engine's KV cache (the
    runner advises it before its blocks are written) and packed weights are."""
    out = torch.empty_like(t)
    advise_huge_pages(out)
    return out.copy_(t)


def test_decode_attention_uniform_vs_skewed() -> None:
    print("\nDecode attention, one layer, batch 64, 12 heads x 64, block 16 "
          "(ms: median [min-max] of", REPEATS, "repeats)")
    print(f"{'backend':8} {'dtype':9} {'batch':36} {'kv tokens':>9} {'ms':>24} {'vs uniform':>10}")
    for dtype_name, dtype in DTYPES.items():
        for backend_name in BACKEND_NAMES:
            backend, base = get_backend(backend_name), 0.0
            for batch_name, lens in BATCHES.items():
                kv_cache, tables = paged_inputs(lens, 1, NUM_HEADS, HEAD_DIM, dtype)
                q = torch.randn(len(lens), NUM_HEADS, HEAD_DIM, dtype=dtype)
                meta = AttentionMetadata.build([1] * len(lens), lens, tables, BLOCK_SIZE, "cpu")

                def step() -> torch.Tensor:
                    meta.workspace.clear()  # count the per-forward index build too
                    return backend.forward(q, kv_cache, 0, meta, HEAD_DIM ** -0.5)

                with torch.inference_mode():
                    timing = measure(step, 5)
                base = base or timing.median_ms
                print(f"{backend_name:8} {dtype_name:9} {batch_name:36} {sum(lens):9} "
                      f"{timing!s:>24} {timing.median_ms / base:9.2f}x")


KERNEL_SHAPES = {"opt-125m (12 heads)": (12, 12), "smollm2-135m (9 heads, 3 KV)": (9, 3)}
COLD_BYTES = 256 << 20  # KV per timed call: well past the CPU's last-level cache


def without_tiles(fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)`` with the bf16 decode kernel's q.k off the AMX tiles."""
    cpu_bf16_attention.TILES = False
    try:
        return fn(*args)
    finally:
        cpu_bf16_attention.TILES = True


def every_layer(kernel: Callable[[int], object], layers: int) -> None:
    for layer in range(layers):
        kernel(layer)


def test_decode_kernel_widths() -> None:
    """The C decode kernel at each vector width on 64 sequences, the kernel
    `cpu_attention.decode` picks by default where that is another one (bf16 on AVX-512
    BF16), and grouped queries fused (each KV head read once for its query heads) against
    expanded into one row per query head (`AttentionBackend.forward`, the path of mixed
    steps). Each call runs every layer of a cache of at least COLD_BYTES, so that the KV
    comes from memory as in a step, not from the last call's cache lines. Rounds interleave
    the variants; median [min-max] over the rounds of the best of 3 calls, per layer, and
    the GB/s of KV that median reads."""
    print(f"\nC decode attention kernel, 64 sequences, {torch.get_num_threads()} threads, this "
          f"CPU's kernel width {cpu_attention.lanes_for(HEAD_DIM)} lanes; ms per layer; load "
          f"average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    backend = get_backend("paged")
    for dtype_name, dtype in DTYPES.items():
        for shape_name, (heads, kv_heads) in KERNEL_SHAPES.items():
            for context in (128, 1024):
                lens = [context] * 64
                layer_bytes = 2 * 64 * context * kv_heads * HEAD_DIM * dtype.itemsize
                layers = -(-COLD_BYTES // layer_bytes)
                kv_cache, tables = paged_inputs(lens, layers, kv_heads, HEAD_DIM, dtype)
                meta = AttentionMetadata.build([1] * 64, lens, tables, BLOCK_SIZE, "cpu")
                q = torch.randn(64, heads, HEAD_DIM, dtype=dtype)
                args = (meta.block_tables, meta.seq_lens, context, HEAD_DIM ** -0.5)
                kernels: dict[str, Callable[[int], object]] = {
                    f"{lanes} lanes": lambda i, lanes=lanes: cpu_attention.decode(
                        q, kv_cache, i, *args, lanes=lanes)
                    for lanes in (cpu_attention.LANES, cpu_attention.WIDE_LANES)}
                if dtype == torch.bfloat16 and cpu_bf16_attention.is_supported(q):
                    kernels["default"] = lambda i: cpu_attention.decode(q, kv_cache, i, *args)
                    if cpu_isa.detect().level == "AMX" and heads != kv_heads:
                        kernels["q.k by vdpbf16ps"] = lambda i: without_tiles(
                            cpu_attention.decode, q, kv_cache, i, *args)
                if heads != kv_heads:
                    kernels["expanded rows"] = lambda i: backend.forward(q, kv_cache, i, meta,
                                                                         HEAD_DIM ** -0.5)
                fns = {name: functools.partial(every_layer, kernel, layers)
                       for name, kernel in kernels.items()}
                rounds: dict[str, list[float]] = {k: [] for k in fns}
                with torch.inference_mode():
                    for r in range(5):
                        names = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
                        for name in names:
                            rounds[name].append(measure(fns[name], 3).min_ms / layers)
                print(f"{dtype_name:9} {shape_name:28} context {context:5}  " + "  ".join(
                    f"{name} {median_range(t)} "
                    f"({layer_bytes / statistics.median(t) / 1e6:.1f} GB/s)"
                    for name, t in rounds.items()), flush=True)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every thread of this process) of one call of `fn`."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


class Floor:
    """Samples this machine's roofline: the FLOP/s of a big square matmul in `dtype` and the
    bytes/s read + written by a 256 MB tensor copy (on huge pages where Linux has them, like
    the engine's KV cache and packed weights), one timed run of each per `sample`, so
    that every timed step gets a floor measured right beside it (the machine is shared).
    Each rate comes per wall second and per CPU second (all threads): on a loaded machine
    the wall rates count time spent waiting for a core, the CPU rates do not."""

    def __init__(self, dtype: torch.dtype, n: int = 2048) -> None:
        # NOTE: on huge pages like the step's KV cache and weights, so that the floor gets
        # the same help from the TLB as the step it bounds
        self.a = on_huge_pages(torch.randn(n, n, dtype=dtype))
        self.b = on_huge_pages(torch.randn(n, n, dtype=dtype))
        self.src = on_huge_pages(torch.ones(64 << 20, dtype=torch.float32))
        self.dst = on_huge_pages(torch.empty_like(self.src))
        self.sample()  # warm-up

    def sample(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """((matmul FLOP/s, copy bytes/s) per wall second, the same per CPU second)."""
        flops, num_bytes = 2 * self.a.shape[0] ** 3, 2 * self.src.numel() * 4
        mm_wall, mm_cpu = timed(lambda: self.a @ self.b)
        copy_wall, copy_cpu = timed(lambda: self.dst.copy_(self.src))
        return (flops / mm_wall, num_bytes / copy_wall), (flops / mm_cpu, num_bytes / copy_cpu)


def step_cost(model: OPTForCausalLM, batch: int, dtype: torch.dtype) -> tuple[float, float]:
    """FLOPs and bytes read of one decode step: weights once, each sequence's KV once."""
    cfg = model.config
    matmul_params = sum(p.numel() for n, p in model.named_parameters()
                        if p.dim() == 2 and "embed_positions" not in n)
    kv_elems = batch * (CONTEXT + 1) * 2 * cfg.hidden_size * cfg.num_layers
    flops = 2 * batch * matmul_params + 2 * kv_elems
    weight_bytes = sum(p.numel() for n, p in model.named_parameters()
                       if "embed_positions" not in n) * dtype.itemsize
    return float(flops), float(weight_bytes + kv_elems * dtype.itemsize)


def test_opt125m_decode_step_vs_roofline() -> None:
    """Each of ROUNDS rounds times one floor sample (matmul, copy) and one step, in turn,
    and divides the two: the ratio's median and range over the rounds is the result, in
    wall time and in CPU time (all threads; robust to waiting for a core). The process's
    allocator is set up as the engine sets it up for a CPU decode (`tune_host_allocator`;
    ASERVE_MALLOC_TUNING=0 leaves glibc's defaults), so that the step's fresh outputs (the
    12.9 MB of batch-64 logits) come from the heap as they do in the engine, not from
    pages faulted in and zeroed anew every step."""
    tuned = tune_host_allocator()
    print(f"\nopt-125m decode step (metadata + forward + logits), context {CONTEXT}, paged; "
          f"{ROUNDS} rounds of (floor sample, step), median [min-max]; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; malloc tuned: {tuned}")
    print(f"{'dtype':9} {'batch':>5} {'step ms':>24} {'floor ms':>24} {'GFLOP/s mm':>11} "
          f"{'GB/s copy':>10} {'x floor (wall)':>20} {'x floor (CPU)':>20}")
    for dtype_name, dtype in DTYPES.items():
        model, cfg = build_preset("opt-125m", dtype, "cpu")
        fit_matmuls_to(model, torch.device("cpu"))  # as the engine's runner does
        # NOTE: the floor takes the fastest GEMM this CPU has for these inputs: without a
        # bf16 GEMM that is float32 on the exactly upcast values (what the engine runs).
        rate_dtype = dtype if has_half_matmul(dtype) else torch.float32
        floor = Floor(rate_dtype)
        for batch in (1, 16, 64):
            kv_cache, tables = paged_inputs([CONTEXT + 1] * batch, cfg.num_layers,
                                            cfg.num_heads, cfg.head_dim, dtype)
            ids = torch.randint(3, cfg.vocab_size, (batch,))
            positions = torch.full((batch,), CONTEXT)
            backend = get_backend("paged")

            def step() -> torch.Tensor:
                meta = AttentionMetadata.build([1] * batch, [CONTEXT + 1] * batch, tables,
                                               BLOCK_SIZE, "cpu")
                return model.compute_logits(model(ids, positions, kv_cache, meta, backend))

            flops, num_bytes = step_cost(model, batch, dtype)
            step_ms, floor_ms, rates, bandwidths, cpu_ratios = [], [], [], [], []
            with torch.inference_mode():
                step()  # warm-up (packs the weights)
                for _ in range(ROUNDS):
                    (rate, bandwidth), (cpu_rate, cpu_bandwidth) = floor.sample()
                    wall, cpu = timed(step)
                    step_ms.append(wall * 1e3)
                    floor_ms.append(max(flops / rate, num_bytes / bandwidth) * 1e3)
                    cpu_ratios.append(cpu / max(flops / cpu_rate, num_bytes / cpu_bandwidth))
                    rates.append(rate / 1e9)
                    bandwidths.append(bandwidth / 1e9)
            ratios = [s / f for s, f in zip(step_ms, floor_ms)]
            print(f"{dtype_name:9} {batch:5} {median_range(step_ms):>24} "
                  f"{median_range(floor_ms):>24} "
                  f"{statistics.median(rates):11.1f} {statistics.median(bandwidths):10.1f} "
                  f"{median_range(ratios):>19}x {median_range(cpu_ratios):>19}x", flush=True)
        print(f"{dtype_name}: floor matmul {rate_dtype} {floor.a.shape[0]}^3")


LINEAR_SHAPES = {"qkv 2304x768": (2304, 768), "out_proj 768x768": (768, 768),
                 "fc1 3072x768": (3072, 768), "fc2 768x3072": (768, 3072),
                 "lm_head 50272x768": (50272, 768)}


def linear_candidates(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor
                      ) -> dict[str, Callable[[], object]]:
    """Every float32 GEMM torch offers this CPU for `F.linear(x, w, b)`, and the C kernel."""
    rows, out = x.shape[0], w.shape[0]
    fns: dict[str, Callable[[], object]] = {"F.linear (MKL)": lambda: F.linear(x, w, b)}
    if torch.backends.mkldnn.is_available():
        dnn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        fns["oneDNN packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, dnn, b, "none",
                                                                          [], "")
    if torch.backends.mkl.is_available():
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
        fns["MKL packed"] = lambda: torch.ops.mkl._mkl_linear(x, mkl, w, b, rows)
    if cpu_gemm.is_available():
        p32, p16 = cpu_gemm.pack(w), cpu_gemm.pack(w.bfloat16())
        fns["C gemm"] = lambda: cpu_gemm.linear(x, p32, out, b)
        fns["C gemm, bf16 panels"] = lambda: cpu_gemm.linear(x, p16, out, b)
    return fns


def test_linear_kernels_at_decode_shapes() -> None:
    """GFLOP per CPU second (all threads) of each GEMM on opt-125m's linear shapes, calls
    interleaved round by round; median of the rounds. Float32 inputs and outputs."""
    print(f"\nfloat32 linear layers, GFLOP per CPU second, median of interleaved rounds; "
          f"{torch.get_num_threads()} threads; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (out, inp) in LINEAR_SHAPES.items():
            w, b = torch.randn(out, inp, generator=g), torch.randn(out, generator=g)
            for rows in (1, 16, 64, 128):
                x = torch.randn(rows, inp, generator=g)
                fns = linear_candidates(w, b, x)
                cpu: dict[str, list[float]] = {k: [] for k in fns}
                for fn in fns.values():
                    fn()  # warm-up
                for _ in range(3 if out > 10000 else 11):
                    for key, fn in fns.items():
                        cpu[key].append(timed(fn)[1])
                flops = 2 * rows * out * inp
                print(f"{name:18} rows {rows:3} " + "  ".join(
                    f"{key} {flops / max(statistics.median(t), 1e-9) / 1e9:6.1f}"
                    for key, t in cpu.items()), flush=True)
