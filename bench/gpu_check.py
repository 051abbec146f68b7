"""One-command GPU check: the gpu-marked tests, each attention backend on uniform vs
skewed batches of equal total KV, decode steps against the measured memory-bandwidth floor, and
an aligned / fcfs / continuous engine run. Writes gpu_check.json and gpu_check.md.

`--cpu-dry-run` runs every code path on tiny shapes on the CPU (Triton falls back to `paged`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO

import torch

from aserve.engine.config import EngineConfig
from aserve.engine.cuda_graphs import DecodeGraphs
from aserve.engine.sequence import Event, IterationRecord
from aserve.entrypoints.offline import run
from bench.harness import RunResult, model_config, run_engine, size_engine, workload_prompts
from bench.metrics import Summary
from bench.report import markdown_table, summary_row
from bench.workloads import synthetic
from models.attention import AttentionBackend, AttentionMetadata, get_backend
from models.backends import BACKEND_NAMES as ATTENTION_BACKENDS
from models.backends import GRAPH_BACKENDS, TRITON_BACKENDS
from models.loader import load_model
from models.opt import OPTForCausalLM

STEP_BACKENDS = ("paged", *TRITON_BACKENDS)
POLICIES = ("aligned", "fcfs", "continuous")
BLOCK_SIZE = 16  # tokens per KV block
LONG_SHARE = 16  # skewed batches: one sequence in LONG_SHARE is long


@dataclass(frozen=True, slots=True)
class Plan:
    """Sizes of one check: the full GPU run or the CPU dry run."""

    device: str
    dtype: str
    models: tuple[str, ...]
    batches: tuple[int, ...]  # attention: batch sizes of the uniform / skewed comparison
    mean_len: int  # attention: mean KV tokens per sequence (uniform length)
    step_batches: tuple[int, ...]  # decode steps timed against the bandwidth floor
    step_len: int  # KV tokens per sequence in those steps
    engine_model: str
    engine_backends: tuple[str, ...]
    num_requests: int  # synthetic 95 %-short workload
    short_range: tuple[int, int]
    long_range: tuple[int, int]
    output_range: tuple[int, int]
    batch_requests: int  # engine sizing: decode KV for about this many median requests
    repeats: int  # timed calls per measurement (median reported)
    copy_bytes: int  # bytes of the bandwidth probe's buffer
    engine_timeout_s: float
    budget_s: float  # sections (and engine runs) starting after this many seconds are skipped
    test_timeout_s: float


GPU_PLAN = Plan("cuda", "float16", ("opt-1.3b", "opt-2.7b"), (16, 64, 256), 1024, (64, 256),
                512, "opt-1.3b", ("triton", "triton-splitk"), 256, (32, 256), (1024, 1792),
                (32, 96), 64, 10, 2 << 30, 150.0, 420.0, 180.0)
DRY_PLAN = Plan("cpu", "float32", ("opt-tiny",), (2, 4), 64, (2, 4), 32, "opt-tiny",
                ("triton",), 16, (4, 24), (60, 100), (2, 6), 4, 2, 16 << 20, 60.0, 240.0,
                120.0)


def median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` after one warm-up call (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def guarded_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """`median_time`, or NaN (logged) when the variant fails, so one failure does not end the
    check (e.g. a reference backend running out of memory at batch 256)."""
    try:
        return median_time(fn, device, repeats)
    except Exception as exc:  # noqa: BLE001 -- a benchmark row, not control flow
        print(f"[gpu_check] variant failed: {type(exc).__name__}: {exc}", flush=True)
        _free(device)
        return math.nan


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Device memory bandwidth in bytes/s: a copy's bytes read plus written over its time."""
    src = torch.ones(num_bytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / median_time(lambda: dst.copy_(src), device, repeats)


def batch_lens(batch: int, mean_len: int, is_skewed: bool) -> list[int]:
    """Uniform: every sequence at mean_len. Skewed: one in LONG_SHARE long, the rest at half
    the mean, with the same total KV tokens."""
    if not is_skewed:
        return [mean_len] * batch
    num_long = max(1, batch // LONG_SHARE)
    short = mean_len // 2
    long_total = batch * mean_len - (batch - num_long) * short
    longs = [long_total // num_long] * num_long
    longs[-1] += long_total - sum(longs)
    return [short] * (batch - num_long) + longs


def paged_batch(lens: list[int], num_layers: int, num_heads: int, head_dim: int,
                dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
    """A filled KV cache (null block 0 zeroed) and decode metadata over shuffled blocks."""
    counts = [math.ceil(n / BLOCK_SIZE) for n in lens]
    ids = list(range(1, sum(counts) + 1))
    random.Random(0).shuffle(ids)
    tables = [ids[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(counts))]
    kv_cache = torch.empty((sum(counts) + 1, num_layers, 2, BLOCK_SIZE, num_heads, head_dim),
                           dtype=dtype, device=device).normal_()  # [blocks, L, 2, bs, H, D]
    kv_cache[0].zero_()
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, BLOCK_SIZE, device)
    return kv_cache, meta


def attention_rows(plan: Plan, model: str, bandwidth: float) -> list[dict[str, object]]:
    """One layer's decode attention per backend, uniform vs skewed, per batch size."""
    return [row for batch in plan.batches for shape in ("uniform", "skewed")
            for row in _attention_case(plan, model, batch, shape, bandwidth)]


@torch.inference_mode()
def _attention_case(plan: Plan, model: str, batch: int, shape: str, bandwidth: float
                    ) -> list[dict[str, object]]:
    cfg = model_config(model)
    device, dtype = torch.device(plan.device), getattr(torch, plan.dtype)
    lens = batch_lens(batch, plan.mean_len, shape == "skewed")
    kv_cache, meta = paged_batch(lens, 1, cfg.num_heads, cfg.head_dim, dtype, device)
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
    kv_bytes = 2 * sum(lens) * cfg.hidden_size * dtype.itemsize
    rows: list[dict[str, object]] = []
    for name in ATTENTION_BACKENDS:
        backend = get_backend(name)
        seconds = guarded_time(
            lambda: backend.forward(q, kv_cache, 0, meta, cfg.head_dim ** -0.5),
            device, plan.repeats)
        rows.append(dict(model=model, batch=batch, shape=shape, backend=name, max_len=max(lens),
                         kv_tokens=sum(lens), time_us=seconds * 1e6,
                         floor_us=kv_bytes / bandwidth * 1e6))
    return rows


def step_rows(plan: Plan, model_name: str, bandwidth: float) -> list[dict[str, object]]:
    """Full decode steps (forward + LM head), eager and as CUDA graphs, vs the floor:
    weights plus the KV read once at the measured bandwidth."""
    device = torch.device(plan.device)
    model = load_model(model_name, plan.dtype, device).model
    rows = [row for batch in plan.step_batches
            for row in _step_case(plan, model, model_name, batch, bandwidth)]
    del model
    _free(device)
    return rows


@torch.inference_mode()
def _step_case(plan: Plan, model: OPTForCausalLM, model_name: str, batch: int,
               bandwidth: float) -> list[dict[str, object]]:
    cfg, device, dtype = model.config, torch.device(plan.device), getattr(torch, plan.dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    lens = [plan.step_len] * batch
    kv_cache, meta = paged_batch(lens, cfg.num_layers, cfg.num_heads, cfg.head_dim, dtype,
                                 device)
    ids = torch.randint(4, cfg.vocab_size, (batch,), device=device)  # [batch]
    positions = torch.full((batch,), plan.step_len - 1, device=device)  # [batch]
    kv_bytes = 2 * sum(lens) * cfg.num_layers * cfg.hidden_size * dtype.itemsize
    floor = (weight_bytes + kv_bytes) / bandwidth
    rows: list[dict[str, object]] = []
    for name, mode, step in _step_fns(plan, model, ids, positions, kv_cache, meta):
        seconds = guarded_time(step, device, plan.repeats)
        rows.append(dict(model=model_name, batch=batch, backend=name, mode=mode,
                         time_ms=seconds * 1e3, floor_ms=floor * 1e3, vs_floor=seconds / floor))
    return rows


def _step_fns(plan: Plan, model: OPTForCausalLM, ids: torch.Tensor, positions: torch.Tensor,
              kv_cache: torch.Tensor, meta: AttentionMetadata
              ) -> list[tuple[str, str, Callable[[], object]]]:
    """(backend, mode, step) for every timed variant; each step rebuilds per-step indexes."""
    fns: list[tuple[str, str, Callable[[], object]]] = []
    for name in STEP_BACKENDS:
        backend = get_backend(name)

        def eager(backend: AttentionBackend = backend) -> object:
            meta.workspace.clear()
            return model.compute_logits(model(ids, positions, kv_cache, meta, backend))
        fns.append((name, "eager", eager))
        if name in GRAPH_BACKENDS:
            graphs = DecodeGraphs(model, backend, BLOCK_SIZE, int(meta.block_tables.shape[1]),
                                  max_batch_size=len(ids), use_graphs=plan.device == "cuda")

            def replay(graphs: DecodeGraphs = graphs) -> object:
                hidden = graphs.forward(ids, positions, kv_cache, meta)
                assert hidden is not None, "a decode step within the buckets runs as a graph"
                return model.compute_logits(hidden)
            fns.append((name, "graph" if plan.device == "cuda" else "graph-dry", replay))
    return fns


def path_row(result: RunResult) -> dict[str, object]:
    """Where one run's time went: the share of its wall time the decode and prefill steps
    computed, and per request the median seconds from arrival to prefill, of the prefill,
    and from the prefill's end to the first decode step (the hand-off through the pool)."""
    times: dict[str, dict[str, float]] = {}
    for event in result.events:
        times.setdefault(event.seq_id, {}).setdefault(event.kind, event.time)

    def median_gap(a: str, b: str) -> float:
        gaps = [t[b] - t[a] for t in times.values() if a in t and b in t]
        return statistics.median(gaps) if gaps else math.nan

    wall = result.wall_time
    return dict(system=result.system, wall_s=wall,
                decode_busy=sum(it.forward_time for it in result.iterations) / wall,
                prefill_busy=sum(it.forward_time for it in result.prefill_iterations) / wall,
                queue_s=median_gap("arrival", "prefill_start"),
                prefill_s=median_gap("prefill_start", "prefill_end"),
                handoff_s=median_gap("prefill_end", "decode_start"))


def engine_summaries(plan: Plan, deadline: float, out: Path
                     ) -> tuple[list[Summary | str], list[dict[str, object]]]:
    """Each policy on a synthetic 95 %-short workload, per Triton backend (offline arrivals).
    Every run's decode and prefill iterations and its lifecycle events other than tokens go
    to engine_iterations.jsonl (one per line, with its system), and its wall time, engine
    start-up included, to stdout."""
    workload = synthetic(plan.num_requests, 0.95, plan.short_range, plan.long_range,
                         plan.output_range, seed=0)
    cfg = model_config(plan.engine_model)
    prompts = workload_prompts(workload, cfg.vocab_size, seed=0)
    sizing = size_engine(workload, cfg, plan.dtype, batch_requests=plan.batch_requests,
                         block_size=BLOCK_SIZE)
    results: list[Summary | str] = []
    paths: list[dict[str, object]] = []
    with (out / "engine_iterations.jsonl").open("w", buffering=1) as log:  # kept if cut short
        for backend in plan.engine_backends:
            for policy in POLICIES:
                system = f"{policy}/{backend}"
                if time.perf_counter() > deadline:
                    results.append(f"{system}: skipped, out of time")
                    continue
                config = EngineConfig.create(
                    model=plan.engine_model, dtype=plan.dtype, attention=backend,
                    policy=policy, prefill_devices=plan.device, decode_devices=plan.device,
                    trace_limit=None, **sizing.options())
                started = time.perf_counter()
                try:
                    result = run(asyncio.wait_for(
                        run_engine(workload, prompts, config, system, realtime=False),
                        min(plan.engine_timeout_s, deadline + 30 - started)))
                    results.append(result.summary())
                    paths.append(path_row(result))
                    _log_run(log, system, result)
                except Exception as exc:  # noqa: BLE001 -- reported as a failed row
                    results.append(f"{system}: {type(exc).__name__}: {exc}")
                print(f"[gpu_check] {system}: {time.perf_counter() - started:.0f} s with "
                      "start-up", flush=True)
                _free(torch.device(plan.device))
    return results, paths


def _log_run(log: IO[str], system: str, result: RunResult) -> None:
    """One JSON line per decode and prefill step of ``result``, then per lifecycle event
    other than a token (each request's path through prefill, pool and decode)."""
    items: list[IterationRecord | Event] = [
        *result.iterations, *result.prefill_iterations,
        *(e for e in result.events if e.kind != "token")]
    log.writelines(json.dumps({"system": system, **asdict(item)}) + "\n" for item in items)


def run_gpu_tests(plan: Plan) -> dict[str, object]:
    """pytest -m gpu over the test files that use the mark, so a test-only package missing on
    the GPU machine fails only the modules that import it."""
    files = sorted(str(p) for p in Path("tests").rglob("test_*.py")
                   if "pytest.mark.gpu" in p.read_text())
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", *files]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=plan.test_timeout_s)
    except subprocess.TimeoutExpired:
        return {"rc": None, "tail": f"timed out after {plan.test_timeout_s} s"}
    return {"rc": proc.returncode, "tail": (proc.stdout + proc.stderr)[-3000:]}


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def environment(plan: Plan) -> dict[str, object]:
    import triton

    on_gpu = plan.device == "cuda" and torch.cuda.is_available()
    device = torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu"
    return dict(device=device, torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), plan=asdict(plan))


def _table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _cell(value: object) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3f}"


def tests_section(plan: Plan, report: dict[str, object], deadline: float, out: Path) -> str:
    report["tests"] = result = run_gpu_tests(plan)
    return f"## gpu-marked tests: rc {result['rc']}\n\n```\n{result['tail']}\n```\n"


def attention_section(plan: Plan, report: dict[str, object], deadline: float, out: Path) -> str:
    bandwidth = float(report["bandwidth_bytes_per_s"])  # type: ignore[arg-type]
    rows = [r for m in plan.models for r in attention_rows(plan, m, bandwidth)]
    report["attention"] = rows
    by_key = {(r["model"], r["batch"], r["backend"], r["shape"]): r for r in rows}
    cells = [[m, b, be, r["time_us"], by_key[(m, b, be, "skewed")]["time_us"],
              by_key[(m, b, be, "skewed")]["time_us"] / r["time_us"],  # type: ignore[operator]
              r["floor_us"]] for (m, b, be, shape), r in by_key.items() if shape == "uniform"]
    header = ["model", "batch", "backend", "uniform µs", "skewed µs", "skewed / uniform",
              "KV floor µs"]
    return f"## decode attention, one layer, {plan.dtype}\n\n{_table(header, cells)}"


def steps_section(plan: Plan, report: dict[str, object], deadline: float, out: Path) -> str:
    bandwidth = float(report["bandwidth_bytes_per_s"])  # type: ignore[arg-type]
    rows = [r for m in plan.models for r in step_rows(plan, m, bandwidth)]
    report["steps"] = rows
    header = ["model", "batch", "backend", "mode", "step ms", "floor ms", "step / floor"]
    cells = [[r[k] for k in ("model", "batch", "backend", "mode", "time_ms", "floor_ms",
                             "vs_floor")] for r in rows]
    return f"## decode step vs bandwidth floor, {plan.dtype}\n\n{_table(header, cells)}"


def engine_section(plan: Plan, report: dict[str, object], deadline: float, out: Path) -> str:
    results, paths = engine_summaries(plan, deadline, out)
    report["engine"] = [summary_row(s) if isinstance(s, Summary) else s for s in results]
    report["engine_paths"] = paths
    parts = [f"## engine, {plan.engine_model}, synthetic 95 % short, {plan.num_requests} "
             "requests (offline)\n"]
    for backend in plan.engine_backends:
        done = [s for s in results if isinstance(s, Summary) and s.system.endswith(backend)]
        base = f"fcfs/{backend}" if any(s.system == f"fcfs/{backend}" for s in done) else None
        parts += [markdown_table(done, baseline=base)] if done else []
    header = ["system", "wall s", "decode busy", "prefill busy", "queue s (median)",
              "prefill s", "prefill end to decode s"]
    cells = [[p["system"], p["wall_s"], p["decode_busy"], p["prefill_busy"], p["queue_s"],
              p["prefill_s"], p["handoff_s"]] for p in paths]
    parts.append(f"### where the time went\n\n{_table(header, cells)}")
    return "\n".join(parts + [f"- failed: {s}\n" for s in results if isinstance(s, str)])


SECTIONS = {"tests": tests_section, "attention": attention_section, "steps": steps_section,
            "engine": engine_section}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="gpu_check_out", help="directory for the reports")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run every code path on tiny shapes on the CPU")
    parser.add_argument("--skip-tests", action="store_true", help="do not run pytest -m gpu")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run, of {','.join(SECTIONS)}")
    parser.add_argument("--engine-backends", default=None,
                        help="comma-separated attention backends of the engine section")
    args = parser.parse_args(argv)
    plan = DRY_PLAN if args.cpu_dry_run else GPU_PLAN
    if args.engine_backends:
        plan = replace(plan, engine_backends=tuple(args.engine_backends.split(",")))
    sections = args.sections.split(",")
    if unknown := sorted(set(sections) - set(SECTIONS)):
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    if plan.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available; use --cpu-dry-run on a machine without a GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    deadline = start + plan.budget_s
    skipped: list[str] = []
    report: dict[str, object] = {"environment": environment(plan), "skipped": skipped}
    bandwidth = copy_bandwidth(torch.device(plan.device), plan.copy_bytes, plan.repeats)
    report["bandwidth_bytes_per_s"] = bandwidth
    md = [f"# GPU check\n\n`{json.dumps(report['environment'])}`\n",
          f"## memory bandwidth (copy, read + write): {bandwidth / 1e9:.1f} GB/s\n"]
    for name, section in SECTIONS.items():
        if (name not in sections or (name == "tests" and args.skip_tests)
                or time.perf_counter() > deadline):
            skipped.append(name)
            continue
        print(f"[gpu_check] {name} at {time.perf_counter() - start:.0f} s", flush=True)
        md.append(section(plan, report, deadline, out))
        _write(out, report, md)
    report["total_s"] = time.perf_counter() - start
    _write(out, report, md)
    print("\n".join(md))
    return 0


def _write(out: Path, report: dict[str, object], md: list[str]) -> None:
    doc = json.dumps(_strict(report), indent=2, default=str, allow_nan=False)
    (out / "gpu_check.json").write_text(doc + "\n")
    (out / "gpu_check.md").write_text("\n".join(md))


def _strict(value: object) -> object:
    """NaN (a failed variant, or no data) becomes null so the JSON stays strict."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
