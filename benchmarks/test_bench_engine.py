"""Engine benchmarks (`pytest bench -m bench`, not CI): offline throughput of
`opt-125m` under `fcfs` and `continuous` beside the transformers peer on the same weights and
requests, and the event loop's lag while `opt-125m` decodes a batch of 32 on the CPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from aserve.engine.config import EngineConfig
from aserve.entrypoints.offline import run as run_async
from bench import bench_cli
from bench.harness import (
    LoopLagProbe,
    RunResult,
    model_config,
    run_engine,
    size_engine,
    workload_prompts,
)
from bench.metrics import percentile
from bench.workloads import Workload, WorkloadRequest

pytestmark = pytest.mark.bench
RESULTS = Path(__file__).resolve().parent / "results"
TARGET_VS_TRANSFORMERS = 3.0  # decode throughput >= 3x transformers generate
MAX_LOOP_LAG_S = 0.05  # a timer task's lag stays under 50 ms
MS = 1e3


def run_cli(name: str, argv: list[str], tmp_path: Path) -> dict[str, object]:
    """`aserve bench` with results in benchmarks/results/NAME.json (+ .md), logs in tmp."""
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{name}.json"
    assert bench_cli.main([*argv, "--json", str(out), "--iterations", str(tmp_path)]) == 0
    print(f"\nload average after the run: {os.getloadavg()}")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def throughput(doc: dict[str, object], system: str) -> float:
    rows = doc["results"]
    assert isinstance(rows, list)
    return float(next(r["decode_throughput"] for r in rows if r["system"] == system))


def test_offline_throughput_vs_transformers(tmp_path: Path) -> None:
    doc = run_cli("offline_vs_transformers", [
        "--workload", "synthetic", "--short-ratio", "0.95", "--num-requests", "256",
        "--length-scale", "0.125", "--offline", "--model", "opt-125m", "--dtype", "bfloat16",
        "--systems", "fcfs,continuous,transformers,transformers-cb"], tmp_path)
    rows = doc["results"]
    assert isinstance(rows, list) and all(r["num_requests"] == 256 for r in rows)
    peer = throughput(doc, "transformers")
    for system in ("fcfs/paged", "continuous/paged", "transformers-cb"):
        ratio = throughput(doc, system) / peer
        verdict = "meets" if ratio >= TARGET_VS_TRANSFORMERS else "misses"
        print(f"{system}: {ratio:.2f}x transformers generate ({verdict} the "
              f"{TARGET_VS_TRANSFORMERS:g}x target)")


def batch_of_32(prompt_len: int = 64, output_len: int = 64) -> Workload:
    reqs = tuple(WorkloadRequest(f"lag-{i}", prompt_len, output_len, 0.0) for i in range(32))
    return Workload("batch32", reqs)


@pytest.mark.parametrize("policy", ["fcfs", "continuous"])
def test_event_loop_lag_while_decoding_batch_of_32(policy: str) -> None:
    workload = batch_of_32()
    arch = model_config("opt-125m")
    sizing = size_engine(workload, arch, "bfloat16", batch_requests=32)
    config = EngineConfig.create(model="opt-125m", dtype="bfloat16", policy=policy,
                                 trace_limit=None, **sizing.options())
    prompts = workload_prompts(workload, arch.vocab_size, seed=0)

    async def measure() -> tuple[LoopLagProbe, RunResult]:
        async with LoopLagProbe(interval=0.005) as probe:
            result = await run_engine(workload, prompts, config, policy, realtime=False)
        return probe, result

    probe, result = run_async(measure())
    batch = max(it.batch_size for it in result.iterations)
    last = result.iterations[-1]
    decoding = probe.lags_between(result.iterations[0].start_time,
                                  last.start_time + last.forward_time)
    print(f"\n{policy}: loop lag while decoding a batch of {batch} ({len(decoding)} ticks): "
          f"max {max(decoding) * MS:.1f} ms, p99 {percentile(decoding, 99) * MS:.1f} ms; "
          f"whole run incl. engine start ({len(probe.lags)} ticks): max "
          f"{probe.max_lag * MS:.1f} ms, p99 {probe.p99_lag * MS:.1f} ms; "
          f"load average {os.getloadavg()}")
    assert batch == 32
    assert max(decoding) < MAX_LOOP_LAG_S

