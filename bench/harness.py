"""Benchmark harness: runs one system (the engine under a policy and an attention backend) on
a workload in this process, collects its lifecycle events and iteration records, summarises.

Every system sees the same request list and, through the preset seed, the same weights.
Metrics come from events only (bench.metrics). Nothing in the package imports this.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from aserve.engine.config import EngineConfig
from aserve.engine.engine import Engine
from aserve.engine.sequence import Event, IterationRecord, SamplingParams
from bench.metrics import DEFAULT_TPOT_SLO, Summary, percentile, summarize
from bench.workloads import Workload, WorkloadRequest
from models.loader import DTYPES, load_config
from scheduler import POLICIES

ENGINE_POLICIES = tuple(POLICIES)  # every registered policy (scheduler/policy.py)
WARMUP_PREFIX = "warmup-"  # request ids of the warm-up run, dropped from the results
NUM_WARMUP = 2  # warm-up requests before the measured run (first-call costs)
BATCH_KV_FRACTION = 0.9  # SchedulerConfig.batch_kv_fraction (share a new batch may take)

OnFinish = Callable[[], None]
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class SystemSpec:
    """One in-process engine system: a policy and a decode attention backend."""

    policy: str
    attention: str = "paged"

    @property
    def name(self) -> str:
        return f"{self.policy}/{self.attention}"


@dataclasses.dataclass(slots=True)
class RunResult:
    """What one system did on one workload: its events, iterations and generated tokens."""

    system: str
    events: list[Event]
    iterations: list[IterationRecord]
    token_ids: dict[str, list[int]]  # workload request_id -> generated token ids
    wall_time: float  # seconds from the first submission to the last finish
    prefill_iterations: list[IterationRecord] = dataclasses.field(default_factory=list)
    probe_iterations: list[IterationRecord] = dataclasses.field(default_factory=list)
    repeat: int = 0  # which of the benchmark's repeated runs this was (0: the first)
    cpu_steal: float = math.nan  # share of the machine's CPU time the hypervisor took meanwhile

    def summary(self, tpot_slo: float = DEFAULT_TPOT_SLO) -> Summary:
        return summarize(self.system, self.events, self.iterations, tpot_target=tpot_slo)


@dataclasses.dataclass(frozen=True, slots=True)
class Sizing:
    """KV sizes of an engine for one workload (blocks of `block_size` tokens).

    `num_decode_blocks` holds about `batch_requests` typical requests at their final length
    (and the longest one), so the pool holds `pool_ratio` times what decode can take: DFS
    has a choice to make (docs/design.md §1).
    """

    block_size: int
    num_decode_blocks: int
    num_prefill_blocks: int
    num_staging_blocks: int
    max_batch_size: int
    min_requests: int
    host_pool_gb: float
    pool_ratio: float  # blocks of the whole workload / num_decode_blocks
    bytes_per_block: int = 0  # KV bytes of one block over all layers, K and V

    @property
    def decode_kv_bytes(self) -> int:
        """The decode device's KV memory: what a peer is given, for equal memory."""
        return self.num_decode_blocks * self.bytes_per_block

    def options(self) -> dict[str, object]:
        """The EngineConfig.create keyword arguments these sizes set."""
        fields = ("block_size", "num_decode_blocks", "num_prefill_blocks",
                  "num_staging_blocks", "max_batch_size", "min_requests", "host_pool_gb")
        return {f: getattr(self, f) for f in fields}


def model_config(model: str, max_position_embeddings: int | None = None) -> Any:
    """The architecture of a preset, a packaged model, a checkpoint directory or a GGUF
    file (`models.loader.load_config`)."""
    return load_config(model, max_position_embeddings)


def size_engine(workload: Workload, model: Any, dtype: str, batch_requests: int = 32,
                block_size: int = 16, max_prefill_tokens: int = 2048) -> Sizing:
    """Decode KV for about one batch of `batch_requests` median requests; the rest fits.

    Raises:
        ValueError: for an empty workload or batch_requests < 1.
    """
    if not workload.requests:
        raise ValueError("workload has no requests to size the engine for")
    if batch_requests < 1:
        raise ValueError(f"batch_requests ({batch_requests}) must be >= 1")
    blocks = sorted(_blocks(r.prompt_len + r.output_len, block_size) for r in workload.requests)
    longest_prompt = max(r.prompt_len for r in workload.requests)
    median = blocks[len(blocks) // 2]
    num_decode = max(batch_requests * median, math.ceil(blocks[-1] / BATCH_KV_FRACTION) + 1)
    num_prefill = 2 * _blocks(max(max_prefill_tokens, longest_prompt), block_size) + blocks[-1]
    bytes_per_block = (2 * model.num_layers * model.num_kv_heads * model.head_dim * block_size
                       * DTYPES[dtype].itemsize)
    pool_gb = max(0.05, 1.25 * sum(blocks) * bytes_per_block / 2**30)
    return Sizing(block_size=block_size, num_decode_blocks=num_decode,
                  num_prefill_blocks=num_prefill, num_staging_blocks=2 * num_decode,
                  max_batch_size=2 * batch_requests, min_requests=batch_requests,
                  host_pool_gb=round(pool_gb, 3), pool_ratio=sum(blocks) / num_decode,
                  bytes_per_block=bytes_per_block)


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def workload_prompts(workload: Workload, vocab_size: int, seed: int) -> list[list[int]]:
    """Every request's prompt token ids, in workload order (the same for every system)."""
    return [workload.prompt_token_ids(r, vocab_size, seed) for r in workload.requests]


def greedy_params(req: WorkloadRequest) -> SamplingParams:
    """Greedy, exactly `output_len` tokens (EOS ignored): the work is fixed by the workload."""
    return SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)


async def run_engine(workload: Workload, prompts: Sequence[list[int]], config: EngineConfig,
                     system: str, realtime: bool = True,
                     on_finish: OnFinish | None = None) -> RunResult:
    """Runs the workload through a fresh engine built from `config`.

    With `realtime`, each request is submitted at its arrival time (asyncio sleep until
    then); otherwise all at once. Warm-up requests run first and are left out.
    """
    async with Engine(config) as engine:
        await _warm_up(engine, prompts)
        start = time.perf_counter()
        outputs = await replay(workload, prompts, realtime, lambda req, ids: _collect(
            engine, ids, greedy_params(req), req.request_id, on_finish))
        wall_time = time.perf_counter() - start
        events = [e for e in engine.events if not e.seq_id.startswith(WARMUP_PREFIX)]
        iterations = [it for it in engine.iterations if it.start_time >= start]
        prefills = [it for it in engine.prefill_iterations if it.start_time >= start]
    token_ids = {req.request_id: out for req, out in zip(workload.requests, outputs)}
    return RunResult(system, events, iterations, token_ids, wall_time, prefills,
                     engine.probe_iterations)


async def replay(workload: Workload, prompts: Sequence[list[int]], realtime: bool,
                 submit: Callable[[WorkloadRequest, list[int]], Coroutine[object, object, T]]
                 ) -> list[T]:
    """Starts `submit(request, prompt)` for every request, at its arrival time (relative to
    now) when `realtime`, else all at once; returns the results in workload order."""
    start = time.perf_counter()
    tasks: list[asyncio.Task[T]] = []
    for req, ids in zip(workload.requests, prompts, strict=True):
        if realtime:
            await asyncio.sleep(max(0.0, start + req.arrival_time - time.perf_counter()))
        tasks.append(asyncio.create_task(submit(req, ids)))
    return list(await asyncio.gather(*tasks))


async def _warm_up(engine: Engine, prompts: Sequence[list[int]]) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    await asyncio.gather(*(
        _collect(engine, list(prompts[i % len(prompts)][:8]), params, f"{WARMUP_PREFIX}{i}")
        for i in range(NUM_WARMUP)))


async def _collect(engine: Engine, prompt: list[int], params: SamplingParams,
                   request_id: str, on_finish: OnFinish | None = None) -> list[int]:
    out = await engine.complete(prompt, params, request_id)
    if out.finish_reason != "length":
        raise RuntimeError(f"request {request_id} ended with {out.finish_reason}: {out.error}")
    if on_finish is not None:
        on_finish()
    return out.token_ids


class LoopLagProbe:
    """A timer task measuring how late the event loop wakes it (seconds), while in use."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval  # seconds between wake-ups asked for
        self.lags: list[float] = []
        self.wake_times: list[float] = []  # perf_counter seconds of each wake-up
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLagProbe:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None, "entered before exit"
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _tick(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval)
            woke = time.perf_counter()
            self.wake_times.append(woke)
            self.lags.append(woke - before - self.interval)

    def lags_between(self, start: float, end: float) -> list[float]:
        """Lags of the wake-ups within [start, end] (perf_counter seconds)."""
        return [lag for at, lag in zip(self.wake_times, self.lags) if start <= at <= end]

    @property
    def max_lag(self) -> float:
        return max(self.lags, default=math.nan)

    @property
    def p99_lag(self) -> float:
        return percentile(self.lags, 99)


def cpu_times() -> tuple[int, int]:
    """(steal, total) CPU time of the machine so far, in clock ticks, from Linux's /proc/stat
    (a virtual machine's "steal": time its hypervisor gave to other guests); (0, 0) where
    there is no /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0, 0
    ticks = [int(x) for x in fields]
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks[:8])


def write_iteration_log(path: str | Path, header: Mapping[str, object],
                        iterations: Sequence[IterationRecord]) -> None:
    """JSON lines: a header (model, dtype, system, ...), then one dict per IterationRecord."""
    with Path(path).open("w") as f:
        f.write(json.dumps({"header": dict(header)}) + "\n")
        for it in iterations:
            f.write(json.dumps(dataclasses.asdict(it)) + "\n")


def read_iteration_log(path: str | Path) -> tuple[dict[str, object], list[IterationRecord]]:
    """The header and records written by `write_iteration_log`."""
    lines = Path(path).read_text().splitlines()
    header = json.loads(lines[0])["header"]
    records = []
    for line in lines[1:]:
        fields = json.loads(line)
        packed = fields.pop("prefill_lengths", ())  # logs written before `new_tokens`
        fields["lengths"] = tuple(fields.get("lengths") or packed)
        fields["new_tokens"] = tuple(fields.get("new_tokens") or packed)
        records.append(IterationRecord(**fields))
    return header, records
