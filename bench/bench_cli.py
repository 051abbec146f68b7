"""`aserve bench`: replays a workload against engine systems (policy x attention backend),
the transformers peer and any OpenAI-compatible server, one after another in one process,
then writes JSON, Markdown, per-system iteration logs (JSON lines) and plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from aserve.engine.config import EngineConfig
from aserve.entrypoints.offline import run as run_async
from bench import report
from bench.harness import (
    ENGINE_POLICIES,
    RunResult,
    Sizing,
    SystemSpec,
    cpu_times,
    model_config,
    run_engine,
    size_engine,
    workload_prompts,
    write_iteration_log,
)
from bench.metrics import DEFAULT_TPOT_SLO, Summary, median_summary, request_metrics
from bench.workloads import WORKLOADS, Workload, load_workload
from models import cpu_isa

# static `generate` batches, continuous batching, vLLM's CPU build (its own virtualenv:
# `make peers`), llama.cpp on a GGUF model's file (llama-cpp-python in that virtualenv)
PEERS = ("transformers", "transformers-cb", "vllm", "llamacpp")
HTTP_SYSTEM = "http"  # the server at --url, in client mode
DEFAULT_LENGTH_SCALE = 0.125  # CPU scale: the paper's lengths / 8
ABLATION = {"aligned/paged": "aligned", "aligned-noprefetch/paged": "no GPU prefetch",
            "fcfs/paged": "neither (fcfs)"}  # Fig. 14's variants and their bar labels
PROGRESS_S = 2.0  # seconds between progress-bar refreshes (logs stay short)


@dataclasses.dataclass(frozen=True, slots=True)
class BenchSettings:
    """How every system of one benchmark run is built and fed."""

    model: str = "opt-125m"
    dtype: str = "bfloat16"
    seed: int = 0  # preset weights and prompt token ids
    batch_requests: int = 32  # decode KV holds about this many median requests
    realtime: bool = True  # replay arrival times (False: everything at time 0)
    url: str | None = None  # client mode: an OpenAI-compatible server
    api_key: str | None = None
    served_model: str | None = None  # model name on that server (default: its first)
    tpot_slo: float = DEFAULT_TPOT_SLO  # goodput's TPOT target (seconds)
    share_kv_memory: bool = True  # the engine's KV stores on one device: one tensor
    fuse_steps: bool = True  # a device's prefill and decode steps that meet: one forward


@dataclasses.dataclass(slots=True)
class WorkloadRun:
    """All systems' results on one workload, with the engine sizing they shared."""

    workload: Workload
    sizing: Sizing
    results: list[RunResult]  # every run, in the order they ran (repeats included)
    tpot_slo: float = DEFAULT_TPOT_SLO  # goodput's TPOT target (seconds)

    @property
    def systems(self) -> list[str]:
        return list(dict.fromkeys(r.system for r in self.results))

    def runs(self, system: str) -> list[RunResult]:
        """Each run of `system`, in repeat order (the order they ran)."""
        return [r for r in self.results if r.system == system]

    @property
    def summaries(self) -> list[Summary]:
        """One row per system: its run, or the median of its repeated runs."""
        return [median_summary([r.summary(self.tpot_slo) for r in self.runs(system)])
                for system in self.systems]


def system_names(systems: Sequence[str], attention: Sequence[str]) -> list[str]:
    """Engine policies expand over the attention backends (`aligned/paged`); peer and
    `http` names stay as they are. Raises ValueError naming an unknown system."""
    names: list[str] = []
    for system in systems:
        if system in ENGINE_POLICIES:
            names.extend(SystemSpec(system, a).name for a in attention)
        elif system in PEERS or system == HTTP_SYSTEM:
            names.append(system)
        else:
            known = ", ".join((*ENGINE_POLICIES, *PEERS, HTTP_SYSTEM))
            raise ValueError(f"system ({system!r}) must be one of {known}")
    return names


def run_workload(workload: Workload, systems: Sequence[str], settings: BenchSettings,
                 on_finish: Callable[[], None] | None = None, repeats: int = 1,
                 first: int = 0, warmup_runs: int = 0) -> WorkloadRun:
    """Runs each named system on the workload, one after another, same prompts; `repeats`
    times, the order rotated by one system each time, starting at `systems[first]` (so
    every system runs in every position: a slow spell of the machine, or a first-run cost,
    does not fall on one system), with the machine's CPU steal recorded for each run.
    `warmup_runs` runs of `systems[first]` go first and are left out of the results."""
    arch = model_config(settings.model)
    sizing = size_engine(workload, arch, settings.dtype, settings.batch_requests)
    prompts = workload_prompts(workload, arch.vocab_size, settings.seed)
    for _ in range(warmup_runs):
        run_system(rotated(systems, first)[0], workload, prompts, sizing, settings, None)
    results = []
    for repeat in range(repeats):
        for name in rotated(systems, first + repeat):
            steal, total = cpu_times()
            result = run_system(name, workload, prompts, sizing, settings, on_finish)
            (steal_after, total_after), result.repeat = cpu_times(), repeat
            if total_after > total:
                result.cpu_steal = (steal_after - steal) / (total_after - total)
            results.append(result)
    return WorkloadRun(workload, sizing, results, settings.tpot_slo)


def rotated(items: Sequence[str], by: int) -> list[str]:
    """`items` starting at position `by` (modulo their count), wrapping around."""
    by %= max(len(items), 1)
    return [*items[by:], *items[:by]]


def run_system(name: str, workload: Workload, prompts: list[list[int]], sizing: Sizing,
               settings: BenchSettings, on_finish: Callable[[], None] | None) -> RunResult:
    """One system on one workload; see `system_names` for the names."""
    s = settings
    if name == HTTP_SYSTEM:
        from bench.http_client import run_http

        if s.url is None:
            raise ValueError("system 'http' needs --url")
        return run_async(run_http(s.url, workload, prompts, s.realtime, s.served_model,
                                  s.api_key, on_finish=on_finish))
    if name in PEERS:
        from bench import peers

        if name == "vllm":
            return peers.run_vllm(s.model, s.dtype, s.seed, workload, prompts, s.realtime,
                                  system=name, on_finish=on_finish,
                                  kv_cache_bytes=sizing.decode_kv_bytes)
        if name == "llamacpp":
            return peers.run_llamacpp(s.model, workload, prompts, s.realtime, system=name,
                                      on_finish=on_finish)
        model = peers.build_hf_model(s.model, s.dtype, s.seed)
        run = peers.run_static_generate if name == "transformers" else peers.run_continuous_batching
        return run(model, workload, prompts, s.realtime, system=name, on_finish=on_finish)
    config = engine_config(name, sizing, s)
    return run_async(run_engine(workload, prompts, config, name, s.realtime, on_finish))


def engine_config(name: str, sizing: Sizing, settings: BenchSettings) -> EngineConfig:
    """The engine behind system `name` ("policy/attention"), on the same preset weights as
    the transformers peer (both from `settings.seed`)."""
    policy, attention = name.split("/")
    return EngineConfig.create(model=settings.model, dtype=settings.dtype,
                               weights_seed=settings.seed, policy=policy,
                               attention=attention, share_kv_memory=settings.share_kv_memory,
                               fuse_steps=settings.fuse_steps,
                               trace_limit=None, **sizing.options())  # the full log


def build_workloads(args: argparse.Namespace, max_len: int) -> list[Workload]:
    """One workload per --short-ratio (a sweep when several), else the named trace."""
    common = dict(num_requests=args.num_requests, length_scale=args.length_scale,
                  max_len=max_len, seed=args.seed)
    if args.workload == "synthetic":
        ranges = {k: v for k, v in (("short_range", args.short_range),
                                    ("long_range", args.long_range),
                                    ("output_range", args.output_range)) if v is not None}
        return [load_workload("synthetic", short_ratio=ratio, rate=args.rate, **common, **ranges)
                for ratio in args.short_ratio]
    if args.workload == "sharegpt4":
        return [load_workload("sharegpt4", rate=args.rate, **common)]
    workload = load_workload(args.workload, **common)
    return [workload.with_rate(args.rate) if args.rate else workload]


def write_outputs(runs: Sequence[WorkloadRun], args: argparse.Namespace,
                  settings: BenchSettings) -> str:
    """JSON (`{"config", "results"}`, each row naming its workload), Markdown, iteration
    logs and plots; returns the Markdown tables."""
    left_out = ("api_key", "json", "plots", "iterations")  # secrets and output paths
    config = {**{k: v for k, v in dataclasses.asdict(settings).items() if k not in left_out},
              **{k: v for k, v in vars(args).items() if k not in left_out},
              "machine": machine(), "load_average": list(os.getloadavg()),
              "sizing": {r.workload.name: dataclasses.asdict(r.sizing) for r in runs}}
    rows = [{**report.summary_row(s), "workload": r.workload.name}
            for r in runs for s in r.summaries]
    each = [{**report.summary_row(result.summary(r.tpot_slo)), "workload": r.workload.name,
             "repeat": result.repeat, "cpu_steal": report.json_safe(result.cpu_steal)}
            for r in runs for result in r.results]
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"config": config, "results": rows, "runs": each}
    out.write_text(json.dumps(doc, indent=2, default=str, allow_nan=False) + "\n")
    tables = "\n".join(f"### {r.workload.name}\n\nCPU: {machine()}\n\n"
                       + markdown(r.summaries)
                       + (f"\n{spread(r)}" if args.repeats > 1 else "") for r in runs)
    out.with_suffix(".md").write_text(tables)
    log_dir = Path(args.iterations) if args.iterations else out.with_suffix(".iterations")
    log_dir.mkdir(parents=True, exist_ok=True)
    for run in runs:
        for result in (r for r in run.results if r.iterations):
            header: dict[str, object] = {"model": settings.model, "dtype": settings.dtype,
                      "system": result.system, "workload": run.workload.name,
                      "share_kv_memory": settings.share_kv_memory,
                      "fuse_steps": settings.fuse_steps}
            file = f"{run.workload.name}__{result.system.replace('/', '-')}"
            file += f"__r{result.repeat}.jsonl" if args.repeats > 1 else ".jsonl"
            write_iteration_log(log_dir / file, header,
                                [*result.probe_iterations, *result.iterations,
                                 *result.prefill_iterations])
    if args.plots:
        write_plots(Path(args.plots), runs, args, settings)
    return tables


def markdown(summaries: Sequence[Summary]) -> str:
    """The summary table with ratios against fcfs and against continuous, when present."""
    systems = [s.system for s in summaries]
    bases: list[str | None] = [b for b in ("fcfs/paged", "continuous/paged") if b in systems]
    return "\n".join(report.markdown_table(summaries, baseline=b) for b in bases or [None])


def spread(run: WorkloadRun) -> str:
    """Repeated runs: each system's decode tok/s and P99 TPOT per run (in repeat order) and
    their median, with the machine's CPU steal per run, and where each run's forward time
    went: steps with prompt tokens (the same prompts for every policy) and decode-only
    steps (the policy's decode work), so a gap between two systems shows as either."""
    lines = ["| system | decode tok/s median | per run | TPOT p99 ms median | per run "
             "| CPU steal % per run | prompt-step forward s per run "
             "| decode-only steps (forward s) per run |", "|---|---|---|---|---|---|---|---|"]
    for system in run.systems:
        results = run.runs(system)
        each = [r.summary(run.tpot_slo) for r in results]
        splits = [forward_split(r) for r in results]
        median = median_summary(each)
        lines.append(" | ".join([
            f"| {system}", report.fmt(median.decode_throughput, 1),
            ", ".join(report.fmt(s.decode_throughput, 1) for s in each),
            report.fmt(median.tpot_p99 * report.MS, 1),
            ", ".join(report.fmt(s.tpot_p99 * report.MS, 1) for s in each),
            ", ".join(report.fmt(r.cpu_steal * 100, 1) for r in results),
            ", ".join(report.fmt(prompt, 1) for prompt, _, _ in splits),
            ", ".join(f"{steps} ({report.fmt(decode, 1)})" for _, decode, steps in splits)]) + " |")
    return "\n".join(lines) + "\n"


def forward_split(result: RunResult) -> tuple[float, float, int]:
    """(forward seconds of the steps with prompt tokens, forward seconds of the decode-only
    steps, number of decode-only steps) of one run; prefill and decode instances alike."""
    steps = [*result.prefill_iterations, *result.iterations]
    prompt = sum(it.forward_time for it in steps if it.num_prefill_tokens > 0)
    decode = [it.forward_time for it in steps
              if it.num_prefill_tokens == 0 and it.batch_size >= 1]
    return prompt, sum(decode), len(decode)


def machine() -> str:
    """The CPU, as every table names it: cores and the instruction sets in use."""
    return f"{os.cpu_count()}-core CPU (shared), {cpu_isa.describe()}"


def write_plots(folder: Path, runs: Sequence[WorkloadRun], args: argparse.Namespace,
                settings: BenchSettings) -> None:
    """Figs. 7 (when sweeping), 8-10, 11, 13, 14 and 15 and the TPOT CDF from this run."""
    folder.mkdir(parents=True, exist_ok=True)
    last = runs[-1]
    caption = report.Caption(machine(), f"{settings.model} {settings.dtype} (random weights)",
                             f"{last.workload.num_requests} requests, "
                             f"length_scale={args.length_scale:g}")
    engine = [r for r in last.results if r.iterations]
    report.plot_ttft_cdf(folder / "fig15_ttft_cdf.png",
                         {r.system: request_metrics(r.events) for r in last.results}, caption)
    report.plot_forward_time_cdf(folder / "fig13_forward_time_cdf.png",
                                 {r.system: r.iterations for r in engine}, caption)
    report.plot_tpot_cdf(folder / "tpot_cdf.png",
                         {r.system: request_metrics(r.events) for r in last.results}, caption,
                         settings.tpot_slo)
    report.plot_schedule_time_cdf(folder / "fig11_schedule_time_cdf.png",
                                  {r.system: r.iterations for r in engine}, caption)
    report.plot_workload_comparison(folder / "fig8_workloads.png",
                                    {r.workload.name: r.summaries for r in runs}, caption)
    thr = {s.system: s.decode_throughput for s in last.summaries}
    ablation = {label: thr[name] for name, label in ABLATION.items() if name in thr}
    if len(ablation) == len(ABLATION):
        report.plot_ablation(folder / "fig14_ablation.png", ablation, caption,
                             baseline=ABLATION["aligned/paged"])
    if len(runs) > 1 and args.workload == "synthetic":
        series = {name: [next(s.decode_throughput for s in r.summaries if s.system == name)
                         for r in runs] for name in (s.system for s in runs[0].summaries)}
        report.plot_throughput_by_short_share(folder / "fig7_short_share.png",
                                              args.short_ratio, series, caption)


def _parser() -> argparse.ArgumentParser:
    from aserve.engine.config import ATTENTION_BACKENDS, DTYPES
    from aserve.entrypoints.args import HELP_FORMATTER

    d = BenchSettings()
    p = argparse.ArgumentParser(prog="aserve bench", description=__doc__,
                                formatter_class=HELP_FORMATTER)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="synthetic",
                   help="synthetic lengths, or a real trace from bench/data/")
    p.add_argument("--short-ratio", type=_floats, default=[0.95],
                   help="share of short requests (synthetic); a comma list sweeps (Fig. 7)")
    p.add_argument("--short-range", type=_range, default=None,
                   help="synthetic: short prompt lengths LOW,HIGH before --length-scale; "
                        "None: 16,1000")
    p.add_argument("--long-range", type=_range, default=None,
                   help="synthetic: long prompt lengths LOW,HIGH; None: 1000,8000")
    p.add_argument("--output-range", type=_range, default=None,
                   help="synthetic: output lengths LOW,HIGH or one length; None: 16,256")
    p.add_argument("--num-requests", type=int, default=64, help="requests per workload")
    p.add_argument("--length-scale", type=float, default=DEFAULT_LENGTH_SCALE,
                   help="multiplies every prompt and output length (CPU scale: 1/8)")
    p.add_argument("--rate", type=float, default=None,
                   help="req/s (Poisson for synthetic/sharegpt4, rescaled trace for azure); "
                        "None: the trace's own times, or all at once for synthetic")
    p.add_argument("--offline", action="store_true", help="every request arrives at time 0")
    p.add_argument("--systems", type=_names, default=["aligned", "fcfs"],
                   help="comma list of engine policies "
                        f"({', '.join(ENGINE_POLICIES)}) and peers ({', '.join(PEERS)})")
    p.add_argument("--attention", type=_names, default=["paged"],
                   help=f"comma list of attention backends ({', '.join(ATTENTION_BACKENDS)}); "
                        "each engine policy runs with each")
    p.add_argument("--share-kv-memory", action=argparse.BooleanOptionalAction,
                   default=d.share_kv_memory,
                   help="the engine's KV stores on one device share one tensor and move KV "
                        "by handing block tables over (--no-share-kv-memory: a copy per move)")
    p.add_argument("--fuse-steps", action=argparse.BooleanOptionalAction,
                   default=d.fuse_steps,
                   help="the engine runs the prefill and decode steps that wait for one device "
                        "together as one forward (--no-fuse-steps: one forward each)")
    p.add_argument("--model", default=d.model,
                   help="a preset name (random weights), a packaged model "
                        "(smollm2-135m-instruct), a checkpoint directory or a .gguf file")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="weights and KV dtype")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seeds the preset weights of every system (the transformers peer "
                        "included), the prompts' token ids and the arrival times")
    p.add_argument("--batch-requests", type=int, default=d.batch_requests,
                   help="size decode KV to hold about this many median requests")
    p.add_argument("--url", default=None, help="client mode: benchmark this server too")
    p.add_argument("--api-key", default=None, help="bearer token for --url")
    p.add_argument("--served-model", default=None,
                   help="model name on the --url server; None: its first")
    p.add_argument("--tpot-slo", type=float, default=d.tpot_slo,
                   help="goodput's per-request TPOT target in seconds (default %(default)s: "
                        "DistServe's chatbot SLO on OPT-13B; CPU runs want a larger one)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every system per workload, the order rotated each time and "
                        "from one workload to the next; tables report each figure's median "
                        "(default %(default)s)")
    p.add_argument("--warmup-runs", type=int, default=1,
                   help="runs of the first system on the first workload before any measured "
                        "run, left out of the results: a process's first run pays costs the "
                        "later ones do not (default %(default)s)")
    p.add_argument("--json", required=True, default=argparse.SUPPRESS,
                   help="results file (.md and .iterations/ beside)")
    p.add_argument("--plots", default=None, help="folder for the PNG figures; None: no plots")
    p.add_argument("--iterations", default=None,
                   help="folder for the iteration logs; None: OUT.iterations beside --json")
    return p


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _range(text: str) -> tuple[int, int]:
    values = [int(x) for x in text.split(",")]
    if len(values) not in (1, 2):
        raise argparse.ArgumentTypeError(f"{text!r} must be LOW,HIGH or one length")
    return (values[0], values[-1])


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str]) -> int:
    """Entry point of `aserve bench`; prints the summary tables at the end."""
    # NOTE: `aserve bench -- --opts` is how argparse's REMAINDER passes leading options.
    args = _parser().parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    settings = BenchSettings(model=args.model, dtype=args.dtype, seed=args.seed,
                             batch_requests=args.batch_requests, realtime=not args.offline,
                             url=args.url, api_key=args.api_key,
                             served_model=args.served_model, tpot_slo=args.tpot_slo,
                             share_kv_memory=args.share_kv_memory,
                             fuse_steps=args.fuse_steps)
    try:
        systems = system_names(args.systems + ([HTTP_SYSTEM] if args.url else []),
                               args.attention)
        workloads = build_workloads(args, model_config(args.model).max_position_embeddings)
    except ValueError as exc:
        print(f"aserve bench: error: {exc}")
        return 2
    if args.repeats < 1:
        print(f"aserve bench: error: --repeats ({args.repeats}) must be >= 1")
        return 2
    if args.warmup_runs < 0:
        print(f"aserve bench: error: --warmup-runs ({args.warmup_runs}) must be >= 0")
        return 2
    total = sum(w.num_requests for w in workloads) * len(systems) * args.repeats
    with tqdm(total=total, unit="req", desc="aserve bench", mininterval=PROGRESS_S) as bar:
        # NOTE: a benchmark process's first run spends more time in prefill than the same
        # system's next runs in the process, and that run was always the first system's:
        # the warm-up run takes that cost. The rotation goes on from one workload
        # to the next (workload i starts at systems[i mod n]) so that no system is first on
        # every workload.
        runs = [run_workload(w, systems, settings, lambda: bar.update(1), args.repeats,
                             first=i, warmup_runs=args.warmup_runs if i == 0 else 0)
                for i, w in enumerate(workloads)]
    print(write_outputs(runs, args, settings))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
