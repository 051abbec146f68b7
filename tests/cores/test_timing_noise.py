"""One workload, one seed, one machine: `aligned` makes the same batch decisions on every
run, whatever the timing noise. The engine runs on a virtual clock with a runner whose every
step (its start-up probe's included) takes the cost model's time times a random factor
within +-15 %, drawn from a noise seed; the engine fits its step-cost model to the probe
(aserve/engine/step_probe.py) and decides with it, as on a real device."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aserve.engine.config import EngineConfig, ModelConfig
from aserve.engine.engine import Engine
from aserve.engine.runner import StepResult, WorkItem
from aserve.engine.sequence import Request, SamplingParams
from aserve.engine.step_probe import CACHE_ENV
from bench.workloads import synthetic
from scheduler.cost_model import CostModel
from sim.loop import Device
from tests.cores.cost_runner import CostRunner
from tests.cores.test_differential import VirtualClockLoop, cost_model

NOISE = 0.15  # each step takes its modelled time times uniform(1 - NOISE, 1 + NOISE)


class NoisyRunner(CostRunner):
    """CostRunner whose step times carry noise, and which leaves the step-cost model to the
    engine (no ``step_time``): the engine probes it and fits, as it does a real runner."""

    def __init__(self, cost: CostModel, device: Device, model: str, rng: random.Random) -> None:
        super().__init__(cost, device, model)
        self.step_time = None  # type: ignore[assignment]
        self.rng = rng

    async def call(self, fn: Callable[..., object], *args: object) -> object:
        return fn(*args)

    def execute_sync(self, items: list[WorkItem], kv_cache: object) -> StepResult:
        """A probe step: no clock moves, the runner reports its (noisy) time."""
        duration = self.cost.iteration_time([i.start + 1 for i in items])
        return StepResult([0] * len(items), [None] * len(items), duration * self._noise())

    def duration(self, decode: list[int], chunks: list[tuple[int, int]]) -> float:
        return super().duration(decode, chunks) * self._noise()

    def _noise(self) -> float:
        return self.rng.uniform(1 - NOISE, 1 + NOISE)


def config() -> EngineConfig:
    return EngineConfig.create(model="opt-tiny", policy="aligned", attention="padded",
                               num_decode_blocks=40, num_prefill_blocks=128,
                               num_staging_blocks=64, host_pool_gb=0.002, min_requests=4,
                               max_batch_size=16, trace_limit=None)


async def run(noise_seed: int) -> Engine:
    """An offline short/long mix through the engine; every step's time noisy."""
    cost, device, rng = cost_model("padded"), Device("cpu"), random.Random(noise_seed)

    def make(model: ModelConfig, dev: torch.device, block_size: int) -> NoisyRunner:
        return NoisyRunner(cost, device, model.model, rng)

    engine = Engine(config(), make)
    await engine.start()
    engine.ctx.clock = asyncio.get_running_loop().time  # type: ignore[union-attr]
    load = synthetic(48, short_ratio=0.8, short_range=(16, 48), long_range=(150, 260),
                     output_range=(8, 40), seed=3)
    queues = [engine.submit(Request(
        request_id=r.request_id, prompt_token_ids=(0,) * r.prompt_len,
        sampling=SamplingParams(max_tokens=r.output_len, ignore_eos=True),
        arrival_time=float(i) * 1e-9)) for i, r in enumerate(load.requests)]
    assert queues
    while engine.stats()["live"]:
        await asyncio.sleep(0.01)
    await engine.stop()
    return engine


def decode_steps(engine: Engine) -> list[tuple[str, tuple[int, ...]]]:
    """Each decode step's instance and its seqs' lengths, in batch order: the decisions."""
    return [(it.instance, it.lengths) for it in engine.iterations
            if it.instance.startswith("decode")]


def on_virtual_clock(noise_seed: int) -> Engine:
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(run(noise_seed))
    finally:
        loop.close()


def test_aligned_decides_the_same_under_timing_noise(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run fits the probe and caches the fit for this machine and probe; runs
    with other noise seeds read it and make the very same decode steps, though every step
    of theirs, probe included, took another time."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    runs = [on_virtual_clock(seed) for seed in range(3)]
    sources = [r.ctx.policy.step_time.source for r in runs]  # type: ignore[union-attr]
    assert sources[0] == "probe" and all(Path(s).parent == tmp_path for s in sources[1:])
    steps = [decode_steps(r) for r in runs]
    assert steps[0] and all(s == steps[0] for s in steps[1:])
    assert len({r.iterations[-1].start_time for r in runs}) == 3  # the clocks did differ
    lengths = [len(set(step)) > 1 for _, step in steps[0]]
    assert any(lengths)  # steps mixed lengths: the decisions had something to decide


def test_the_simulator_driven_aligned_decides_the_same_under_timing_noise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same cores in the simulator, on the padded model calibrated on the development
    CPU: every step's time noisy, the decisions (its waits counted in steps, not seconds)
    those of the noise-free run."""
    from benchmarks.test_bench_cpu_pays import SCALED_DOWN_RECORDS
    from scheduler.calibrate import load_records
    from sim import drivers, get_geometry, get_hardware, simulate
    from sim.validate import calibration_from_header, cluster_for_bench

    header: dict[str, object] = {}
    records: list[dict[str, object]] = []
    for path in sorted(SCALED_DOWN_RECORDS.glob("*padded.jsonl")):
        if "continuous" not in path.name:
            head, recs = load_records(path)
            header.update(head)
            records += recs
    calibration = calibration_from_header({**header, "attention": "padded"}, records)
    hardware = dataclasses.replace(get_hardware(calibration.hardware),
                                   dtype_bytes=calibration.dtype_bytes)
    cost = CostModel(get_geometry(calibration.model), hardware, calibration.params, "padded")
    load = synthetic(40, short_ratio=0.88, short_range=(24, 200), long_range=(600, 1100),
                     output_range=96, seed=0)
    cluster = cluster_for_bench(header, load, batch_requests=10)
    exact = drivers.SimContext.forward_time

    def steps(seed: int | None) -> list[tuple[int, ...]]:
        rng = random.Random(seed)
        noisy = exact if seed is None else (
            lambda ctx, *step: exact(ctx, *step) * rng.uniform(1 - NOISE, 1 + NOISE))
        monkeypatch.setattr(drivers.SimContext, "forward_time", noisy)
        result = simulate(load, "aligned", cluster, cost)
        return [it.lengths for it in result.iterations if it.instance.startswith("decode")]

    base = steps(None)
    assert base and all(steps(seed) == base for seed in range(5))
