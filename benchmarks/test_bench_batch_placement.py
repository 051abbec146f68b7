"""Where the pool's next batch goes with several decode instances: the waiting instance with
the most room (`BatcherCore.roomiest`, the default) against index order (decode0 first), in
the simulator at paper scale (OPT-13B on H100s, the cost model's priors).

Cells: ShareGPT4, Azure conversation and two synthetic mixes (70 % short; 90 % short with
10 % of prompts 1,024-1,792 tokens), offline, on 2 prefill + 6 decode and on 4 + 4 GPUs,
the per-seq and split-K kernels, ``ASERVE_PLACEMENT_SEEDS`` samples each (default three),
for `aligned`, fcfs and `aligned-loose`: each run once with each order. Writes
``benchmarks/results/batch_placement.md`` (about 10 minutes on two cores)::

    .venv/bin/python -m pytest -s -m bench benchmarks/test_bench_batch_placement.py
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from aserve.cores.batcher import BatcherCore
from bench.workloads import Workload, load_workload
from sim import CostModel, cluster_for, get_geometry, get_hardware, simulate

pytestmark = pytest.mark.bench
RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = ("sharegpt4", "azure-conv", "synthetic", "synthetic-long")
SPLITS = ((2, 6), (4, 4))
KERNELS = ("per-seq", "split-k")
SYSTEMS = ("aligned", "fcfs", "aligned-loose")
ORDERS = ("most room", "index")
SEEDS = tuple(int(s) for s in os.environ.get("ASERVE_PLACEMENT_SEEDS", "0,1,2").split(","))
NUM_REQUESTS = 1000  # synthetic-long: 400, as tests/sim/test_decode_balance.py

ROOMIEST = BatcherCore.roomiest


def index_order(self: BatcherCore, instances: list[int]) -> int | None:
    """The baseline: the first waiting instance by index, whatever its room."""
    return min(instances, default=None)


def workload_of(name: str, seed: int) -> Workload:
    if name == "synthetic-long":
        return load_workload("synthetic", short_ratio=0.9, short_range=(16, 256),
                             long_range=(1024, 1792), output_range=(128, 256),
                             num_requests=400, max_len=2048, seed=seed)
    if name == "synthetic":
        return load_workload("synthetic", num_requests=NUM_REQUESTS, short_ratio=0.7,
                             seed=seed)
    if name.startswith("azure"):
        return load_workload(name, num_requests=NUM_REQUESTS, offline=True, seed=seed)
    return load_workload(name, num_requests=NUM_REQUESTS, seed=seed)


Cell = tuple[str, tuple[int, int], str, int, str, str]  # workload, split, kernel, seed, ...


def run(cell: Cell) -> tuple[Cell, float, float]:
    """One run in a worker process: decode tok/s and P99 TPOT."""
    name, split, kernel, seed, system, order = cell
    BatcherCore.roomiest = ROOMIEST if order == "most room" else index_order  # this process
    geometry, hardware = get_geometry("opt-13b"), get_hardware("h100")
    cluster = cluster_for(hardware, geometry, *split, min_requests=128)
    result = simulate(workload_of(name, seed), system, cluster,
                      CostModel(geometry, hardware, kernel=kernel))
    assert result.num_finished == result.num_requests, cell
    summary = result.summary()
    return cell, summary.decode_throughput, summary.tpot_p99


def _span(values: Sequence[float]) -> str:
    return f"{statistics.geometric_mean(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def test_the_most_room_first_against_index_order() -> None:
    """Over every run, the most room first has at least index order's throughput and at
    most its P99 TPOT (geometric means of the paired runs' ratios)."""
    cells = [(w, split, k, seed, system, order) for w in WORKLOADS for split in SPLITS
             for k in KERNELS for seed in SEEDS for system in SYSTEMS for order in ORDERS]
    with ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        results = {cell: (tok, tpot) for cell, tok, tpot in pool.map(run, cells)}
    tok: dict[tuple[str, ...], list[float]] = defaultdict(list)
    tpot: dict[tuple[str, ...], list[float]] = defaultdict(list)
    for (w, split, k, seed, system, order), (t, p) in results.items():
        if order != "most room":
            continue
        base_t, base_p = results[(w, split, k, seed, system, "index")]
        key = (w, f"{split[0]}+{split[1]}", k, system)
        tok[key].append(t / base_t)
        tpot[key].append(p / base_p)
    lines = [
        "Batch placement with several decode instances: the most room first (the default) "
        "against index order, paired runs (most room ÷ index order; geometric mean "
        f"[range] over seeds {','.join(map(str, SEEDS))}); OPT-13B on H100s, the cost "
        "model's priors, offline",
        "",
        "| workload | GPUs (prefill + decode) | kernel | system | decode tok/s | P99 TPOT |",
        "|---|---|---|---|---|---|"]
    for key in sorted(tok):
        lines.append(f"| {' | '.join(key)} | {_span(tok[key])} | {_span(tpot[key])} |")
    every_tok = [x for v in tok.values() for x in v]
    every_tpot = [x for v in tpot.values() for x in v]
    for split in sorted({key[1] for key in tok}):
        t = [x for key, v in tok.items() if key[1] == split for x in v]
        p = [x for key, v in tpot.items() if key[1] == split for x in v]
        lines.append(f"\n{split}: decode tok/s {_span(t)}, P99 TPOT {_span(p)} "
                     f"({len(t)} pairs)")
    lines.append(f"\nAll {len(every_tok)} pairs: decode tok/s {_span(every_tok)}, "
                 f"P99 TPOT {_span(every_tpot)}")
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "batch_placement.md").write_text(text)
    assert statistics.geometric_mean(every_tok) >= 1.0
    assert statistics.geometric_mean(every_tpot) <= 1.0
