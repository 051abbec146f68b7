"""The Ray driver's cost on one machine (`pytest -m bench`, not CI): one workload through
the single-process engine (stores sharing one tensor, and a tensor per store) and through a
local two-node Ray cluster (prefill on the head node, decode on the other), rotated,
`REPEATS` times each. Reports output tokens/s, the decode step's forward time, the cluster's
time per forward beyond the forward (the call to the worker), and each kind of KV move's
time. Results land in benchmarks/results/cluster.{json,md}.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from aserve.engine.engine import Engine
from aserve.engine.sequence import SamplingParams
from tests.conftest import make_config

pytestmark = pytest.mark.bench
ray = pytest.importorskip("ray", reason="the cluster extra (Ray) is not installed")

RESULTS = Path(__file__).parent / "results"
REPEATS = int(os.environ.get("ASERVE_CLUSTER_REPEATS", "3"))
NUM_REQUESTS = 32
OUTPUT_TOKENS = 32
ENGINE = dict(model="opt-125m", num_threads=2, max_batch_size=32, num_decode_blocks=512,
              num_prefill_blocks=256, num_staging_blocks=512, host_pool_gb=0.5)
SYSTEMS = {"one process": dict(share_kv_memory=True),
           "one process, a tensor per store": dict(share_kv_memory=False),
           "2-node Ray cluster": dict(share_kv_memory=True)}


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 50000) for _ in range(rng.randint(64, 256))]
            for _ in range(NUM_REQUESTS)]


async def run(engine: Engine) -> dict[str, Any]:
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    async with engine:
        began = time.perf_counter()
        await asyncio.gather(*(engine.complete(p, params) for p in prompts()))
        wall = time.perf_counter() - began
        engine.check_integrity()
        steps = [it.forward_time for it in engine.iterations
                 if it.instance.startswith("decode") and it.batch_size]
        moves: dict[str, list[float]] = defaultdict(list)
        for t in engine.transfers:
            moves[f"{t.src.rstrip('0123456789')} -> {t.dst.rstrip('0123456789')}"].append(
                t.end_time - t.start_time)
        overheads = getattr(engine, "call_overheads", dict)()
    return {"wall_s": wall, "tok_per_s": NUM_REQUESTS * OUTPUT_TOKENS / wall,
            "decode_steps": len(steps), "decode_forward_ms": 1e3 * statistics.mean(steps),
            "call_overhead_ms": {k: 1e3 * v for k, v in overheads.items()},
            "move_ms": {k: 1e3 * statistics.mean(v) for k, v in moves.items()},
            "num_moves": {k: len(v) for k, v in moves.items()}}


def test_the_cluster_against_one_process() -> None:
    from aserve.cluster.engine import ClusterEngine
    from tests.cluster.conftest import start_cluster

    local = start_cluster(1)
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    try:
        names = list(SYSTEMS)
        for i in range(REPEATS):
            for name in names[i % len(names):] + names[:i % len(names)]:  # rotated
                kw = {**ENGINE, **SYSTEMS[name]}
                engine = (ClusterEngine(make_config(ray_address=local.address, **kw))
                          if "Ray" in name else Engine(make_config(**kw)))
                runs[name].append(asyncio.run(run(engine)))
    finally:
        ray.shutdown()
        local.cluster.shutdown()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cluster.json").write_text(json.dumps(runs, indent=1))
    (RESULTS / "cluster.md").write_text(table(runs))
    assert all(len(r) == REPEATS for r in runs.values())


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Medians over the repeats, [min-max] in brackets."""
    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    def per_key(rs: list[dict[str, Any]], field: str, counts: str | None = None) -> str:
        keys = sorted({k for r in rs for k in r[field]})
        parts = [f"{k}: {cell([r[field][k] for r in rs])}"
                 + (f" ({rs[0][counts][k]})" if counts else "") for k in keys]
        return "; ".join(parts) or "-"

    lines = ["| system | output tok/s | decode forward ms | call overhead ms / forward "
             "| KV move ms (moves per run) |", "|---|---|---|---|---|"]
    for name, rs in runs.items():
        lines.append(f"| {name} | {cell([r['tok_per_s'] for r in rs])} "
                     f"| {cell([r['decode_forward_ms'] for r in rs])} "
                     f"| {per_key(rs, 'call_overhead_ms')} "
                     f"| {per_key(rs, 'move_ms', 'num_moves')} |")
    return "\n".join(lines) + "\n"


MOVE_BLOCKS = (1, 8, 32)  # blocks per move (opt-125m: 16 tokens each)
MOVE_REPEATS = 20


def test_one_kv_move_between_nodes_against_one_in_a_process() -> None:
    """The time of one move alone (nothing else running): between two workers on two
    nodes through the object store, against a copy between two stores of one process.
    Results land in benchmarks/results/cluster_moves.md."""
    import torch

    from aserve.cluster.worker import NodeWorker
    from aserve.engine.config import ModelConfig
    from tests.cluster.conftest import start_cluster
    from transport.kv import KVGeometry
    from transport.remote import NodeStores, ObjectStoreTransport

    geometry = KVGeometry(12, 12, 64, 16, torch.float32)  # opt-125m
    layout = {"staging0": ("cpu", 64)}, {"decode0": ("cpu", 64)}
    local = start_cluster(1)
    rows = []
    try:
        remote = ray.remote(NodeWorker)
        src, dst = (remote.options(resources={r: 1}, num_cpus=0).remote(
            ModelConfig(model="opt-tiny"), "cpu", 16, 0, 1)
            for r in ("aserve_prefill", "aserve_decode"))
        ray.get([src.open_stores.remote(layout[0], geometry, False),
                 dst.open_stores.remote(layout[1], geometry, False)])
        stores = NodeStores({**layout[0], **layout[1]}, geometry, False)
        transport = ObjectStoreTransport()
        for n in MOVE_BLOCKS:
            ids = list(range(1, n + 1))
            between, within = [], []
            for _ in range(MOVE_REPEATS):
                began = time.perf_counter()
                asyncio.run(transport.send(src, "staging0", ids, dst, "decode0", ids))
                between.append(time.perf_counter() - began)
                began = time.perf_counter()
                stores.copy_blocks("staging0", ids, "decode0", ids)
                within.append(time.perf_counter() - began)
            rows.append(f"| {n} | {n * geometry.bytes_per_block / 2**20:.1f} "
                        f"| {1e3 * statistics.median(between):.2f} "
                        f"| {1e3 * statistics.median(within):.2f} |")
    finally:
        ray.shutdown()
        local.cluster.shutdown()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cluster_moves.md").write_text(
        "| blocks | MiB | between two nodes ms (median) | within one process ms (median) |\n"
        "|---|---|---|---|\n" + "\n".join(rows) + "\n")
