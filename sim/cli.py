"""`aserve sim`: simulate policies at paper scale on the cost model (sim/).

    aserve sim [run] --workload azure-code --model opt-13b --hardware h100 --prefill 2
        --decode 6 --systems aligned,fcfs,continuous --kernel per-seq,split-k --json OUT
        --plots DIR [--calibration FILE] [--num-requests N] [--split best [--gpus 8]]
    aserve sim calibrate RECORDS.jsonl --out FILE [--model M --hardware H --kernel K]
    aserve sim validate --records RECORDS.jsonl --measured BENCH.json --workload ...
    aserve sim nodes [--links rdma-400g,ethernet-100g] ... (sim/nodes.py: two nodes)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from aserve.engine.config import SchedulerConfig
from aserve.entrypoints.args import HELP_FORMATTER, spread_arg
from bench.metrics import DEFAULT_TPOT_SLO, Summary, request_metrics
from bench.report import (
    Caption,
    markdown_table,
    plot_forward_time_cdf,
    plot_tpot_cdf,
    plot_ttft_cdf,
    plot_workload_comparison,
    write_json,
)
from bench.workloads import Workload, load_workload
from models.backends import ATTENTION_KERNELS
from scheduler.calibrate import (
    DTYPE_BYTES,
    fit,
    load_calibration,
    load_records,
    save_calibration,
)
from scheduler.cost_model import KERNELS, CostModel, CostParams, KernelKind, get_geometry
from scheduler.hardware import get_hardware
from sim.cluster import ClusterConfig, cluster_for
from sim.search import (
    DEFAULT_HORIZON,
    DEFAULT_MAX_EVENTS,
    Placement,
    best_split,
    splits_of,
)
from sim.validate import validate

ENGINE = SchedulerConfig()  # the engine's defaults

PAPER_MIN_REQUESTS = 128  # the paper's example of a batch that saturates a GPU
SPLIT_MODES = ("fixed", "best")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="azure-code",
                        help="synthetic | azure-code | azure-conv | sharegpt4")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests to take; None: the whole trace (synthetic: 1000)")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="azure: replay this many times faster than the trace")
    parser.add_argument("--rate", type=float, default=None,
                        help="mean arrival rate (req/s); synthetic/sharegpt4 default offline")
    parser.add_argument("--offline", action="store_true", help="every request arrives at 0")
    parser.add_argument("--length-scale", type=float, default=1.0,
                        help="multiplies every prompt and output length")
    parser.add_argument("--short-ratio", type=float, default=0.95, help="synthetic only")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds synthetic lengths and arrival times")


def build_workload(args: argparse.Namespace) -> Workload:
    """The workload the arguments name. Raises ValueError for bad values."""
    common = dict(length_scale=args.length_scale, seed=args.seed)
    if args.workload.startswith("azure-"):
        workload = load_workload(args.workload, num_requests=args.num_requests,
                                 rate_scale=args.rate_scale, offline=args.offline, **common)
        return workload.with_rate(args.rate) if args.rate and not args.offline else workload
    rate = None if args.offline else args.rate
    if args.workload == "synthetic":
        return load_workload("synthetic", num_requests=args.num_requests or 1000, rate=rate,
                             short_ratio=args.short_ratio, **common)
    return load_workload(args.workload, num_requests=args.num_requests, rate=rate, **common)


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aserve sim", description=__doc__,
                                     formatter_class=HELP_FORMATTER)
    add_workload_args(parser)
    parser.add_argument("--model", default="opt-13b", help="model geometry to cost")
    parser.add_argument("--hardware", default="h100", help="device to cost (a hardware preset)")
    parser.add_argument("--prefill", type=int, default=2, help="prefill instances (devices)")
    parser.add_argument("--decode", type=int, default=6, help="decode instances (devices)")
    parser.add_argument("--systems", default="aligned,fcfs,continuous",
                        help="comma list of policies to simulate")
    parser.add_argument("--kernel", default="per-seq,split-k",
                        help=f"comma list of {', '.join(KERNELS)}")
    parser.add_argument("--calibration", default=None, help="fitted constants (JSON)")
    parser.add_argument("--min-requests", type=int, default=None,
                        help=f"DFS min_requests; None: {PAPER_MIN_REQUESTS} on GPUs, else "
                             f"{ENGINE.min_requests}")
    parser.add_argument("--max-batch-size", type=int, default=ENGINE.max_batch_size,
                        help="most sequences in one decode iteration")
    parser.add_argument("--max-prefill-tokens", type=int, default=ENGINE.max_prefill_tokens,
                        help="token budget of one prefill step")
    parser.add_argument("--max-spread", type=spread_arg, default=ENGINE.max_spread,
                        help="aligned: the alignment bound (default %(default)s; 'off': the "
                             "paper's looser rules)")
    parser.add_argument("--split", choices=SPLIT_MODES, default="fixed",
                        help="fixed: the --prefill/--decode split for every system; best: "
                             "each pool-based system at the split of --gpus with the "
                             "highest decode throughput (DistServe's placement search), "
                             "continuous on all of them (default %(default)s)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="--split best: devices to split; None: --prefill + --decode")
    parser.add_argument("--tpot-slo", type=float, default=DEFAULT_TPOT_SLO,
                        help="goodput's per-request TPOT target in seconds (default "
                             "%(default)s: DistServe's chatbot SLO on OPT-13B)")
    parser.add_argument("--horizon", type=float, default=DEFAULT_HORIZON,
                        help="cut a run off this many simulated seconds after the last "
                             "arrival and report it as CUT OFF (default %(default)s)")
    parser.add_argument("--max-events", type=int, default=DEFAULT_MAX_EVENTS,
                        help="cut a run off after this many simulator events, so a livelock "
                             "is a reported failure, not a hang (default %(default)s)")
    parser.add_argument("--json", default=None, help="write results here; None: print only")
    parser.add_argument("--plots", default=None,
                        help="write figures into this folder; None: no figures")
    return parser


def _kernels(text: str) -> list[KernelKind]:
    kernels = [k.strip() for k in text.split(",") if k.strip()]
    for kernel in kernels:
        if kernel not in KERNELS:
            raise ValueError(f"kernel ({kernel!r}) must be one of {KERNELS}")
    return kernels  # type: ignore[return-value]


def run(args: argparse.Namespace) -> int:
    """Simulates every (kernel, system) pair; prints tables and the aligned ratios."""
    geometry, hw = get_geometry(args.model), get_hardware(args.hardware)
    params = CostParams()
    if args.calibration:
        params = load_calibration(args.calibration).params
    min_requests = args.min_requests or (PAPER_MIN_REQUESTS if hw.is_gpu else ENGINE.min_requests)

    def config_for(num_prefill: int, num_decode: int) -> ClusterConfig:
        return cluster_for(hw, geometry, num_prefill, num_decode, min_requests=min_requests,
                           max_batch_size=args.max_batch_size,
                           max_prefill_tokens=args.max_prefill_tokens,
                           max_spread=args.max_spread)

    splits = [(args.prefill, args.decode)]
    if args.split == "best":
        splits = splits_of(args.gpus or args.prefill + args.decode)
    config = config_for(*splits[0])  # also checks that the weights fit
    workload = build_workload(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    kernels = _kernels(args.kernel)
    where = (f"{args.prefill}+{args.decode}" if args.split == "fixed"
             else f"each at its best split of {splits[0][0] + splits[0][1]}")
    print(f"# {workload.name}: {workload.num_requests} requests, {args.model} on {where} x "
          f"{hw.name} (continuous: {len(config.colocated_devices)} colocated)\n")
    results: dict[str, list[Placement]] = {}
    for kernel in kernels:
        cost = CostModel(geometry, hw, params, kernel)
        results[kernel] = [_place(workload, system, splits, config_for, cost, args)
                           for system in systems]
    summaries = {k: [_labelled(p, k, len(kernels), args) for p in ps]
                 for k, ps in results.items()}
    for name, rows in summaries.items():
        base = next((s.system for s in rows if s.system.startswith("fcfs")), None)
        print(f"## kernel: {name}\n\n{markdown_table(rows, baseline=base)}")
        print(ratio_lines(rows))
    flat = [s for rows in summaries.values() for s in rows]
    if args.json:
        write_json(args.json, {**vars(args), "cluster": repr(config), "params": repr(params),
                               "placements": {s.system: _placement_json(p) for k, ps in
                                              results.items() for p, s in
                                              zip(ps, summaries[k])}}, flat)
    if args.plots:
        _plots(Path(args.plots), results, summaries, workload, args)
    return 0


def _place(workload: Workload, system: str, splits: list[tuple[int, int]],
           config_for: Callable[[int, int], ClusterConfig], cost: CostModel,
           args: argparse.Namespace) -> Placement:
    placement = best_split(workload, system, splits, config_for, cost, args.horizon,
                           args.max_events)
    result = placement.result
    tried = ", ".join(f"{p}+{d}: {t:.0f}" for (p, d), t in placement.tried.items()
                      if p) if len(placement.tried) > 1 else ""
    print(f"  simulated {placement.label:24s} [{cost.kernel}]: {result.wall_time:6.1f} s wall "
          f"({result.policy_time:.1f} s in policy), {result.num_finished}/"
          f"{result.num_requests} finished, {result.end_time:.1f} s simulated, "
          f"{result.num_loop_events} events" + (f"; tok/s by split {tried}" if tried else ""))
    return placement


def _placement_json(placement: Placement) -> dict[str, object]:
    return {"split": list(placement.split), "finished": placement.finished,
            "imbalance_share": placement.imbalance_share,
            "tried": {f"{p}+{d}": t for (p, d), t in placement.tried.items()}}


def _labelled(placement: Placement, kernel: str, num_kernels: int,
              args: argparse.Namespace) -> Summary:
    summary = placement.summary(args.tpot_slo)
    name = placement.label if args.split == "best" or not placement.finished else summary.system
    return replace(summary, system=f"{name} [{kernel}]" if num_kernels > 1 else name)


def ratio_lines(rows: list[Summary]) -> str:
    """aligned over each other system: decode throughput and P99 TPOT (lower is better)."""
    aligned = next((s for s in rows if s.system.split(" ")[0] == "aligned"), None)
    if aligned is None:
        return ""
    lines = []
    for other in rows:
        if other is aligned:
            continue
        lines.append(f"- aligned / {other.system}: decode throughput "
                     f"{aligned.decode_throughput / other.decode_throughput:.2f}x, "
                     f"P99 TPOT {other.tpot_p99 / aligned.tpot_p99:.2f}x lower")
    return "\n".join(lines) + "\n"


def _plots(folder: Path, results: dict[str, list[Placement]],
           summaries: dict[str, list[Summary]], workload: Workload,
           args: argparse.Namespace) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    caption = Caption(machine=f"simulated {args.prefill}+{args.decode} x {args.hardware}",
                      model=f"{args.model} (cost model)",
                      scale=f"{workload.name}, {workload.num_requests} requests")
    plot_workload_comparison(folder / "throughput_tpot.png", {workload.name: [
        s for rows in summaries.values() for s in rows]}, caption)
    named = {s.system: p.result for k, ps in results.items() for p, s in zip(ps, summaries[k])}
    plot_forward_time_cdf(folder / "forward_time_cdf.png",
                          {n: r.iterations for n, r in named.items()}, caption)
    metrics = {n: request_metrics(r.events) for n, r in named.items()}
    plot_ttft_cdf(folder / "ttft_cdf.png", metrics, caption)
    plot_tpot_cdf(folder / "tpot_cdf.png", metrics, caption, args.tpot_slo)


def calibrate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="aserve sim calibrate",
                                     formatter_class=HELP_FORMATTER)
    parser.add_argument("records", nargs="+",
                        help="iteration logs (JSON lines: header + records), one per system")
    parser.add_argument("--out", required=True, default=argparse.SUPPRESS,
                        help="write the fitted constants (JSON) here")
    parser.add_argument("--model", default=None, help="None: the header's model")
    parser.add_argument("--hardware", default=None, help="None: the header's, else cpu")
    parser.add_argument("--kernel", default=None, help="None: from the header's attention")
    args = parser.parse_args(argv)
    header, records = load_all(args.records)
    kernel = args.kernel or ATTENTION_KERNELS.get(str(header.get("attention", "paged")),
                                                  "split-k")
    calibration = fit(records, model=args.model or str(header.get("model", "opt-125m")),
                      hardware=args.hardware or str(header.get("hardware", "cpu")),
                      kernel=_kernels(kernel)[0],
                      dtype_bytes=DTYPE_BYTES.get(str(header.get("dtype", ""))))
    save_calibration(args.out, calibration)
    print(json.dumps({"params": asdict(calibration.params),
                      "median_rel_error": calibration.median_rel_error}))
    return 0


def load_all(paths: list[str]) -> tuple[dict[str, object], list[dict[str, object]]]:
    """Records of several iteration logs (one per system) under the first file's header."""
    header: dict[str, object] = {}
    records: list[dict[str, object]] = []
    for path in paths:
        file_header, file_records = load_records(path)
        header = header or file_header
        records += file_records
    return header, records


def validate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="aserve sim validate",
                                     formatter_class=HELP_FORMATTER)
    add_workload_args(parser)
    parser.add_argument("--records", required=True, nargs="+", default=argparse.SUPPRESS,
                        help="iteration logs of the calibration run (JSON lines)")
    parser.add_argument("--measured", required=True, default=argparse.SUPPRESS,
                        help="benchmark JSON of the run to predict")
    args = parser.parse_args(argv)
    header, records = load_all(args.records)
    measured = json.loads(Path(args.measured).read_text())["results"]
    validate(header, records, measured, build_workload(args))
    return 0


def main(argv: list[str]) -> int:
    """Entry point of `aserve sim` (dispatched from aserve/entrypoints/cli.py)."""
    from sim.nodes import main as nodes_main

    commands = {"calibrate": calibrate_main, "validate": validate_main, "nodes": nodes_main}
    try:
        if argv and argv[0] in commands:
            return commands[argv[0]](argv[1:])
        started = time.perf_counter()
        code = run(_run_parser().parse_args(argv[1:] if argv[:1] == ["run"] else argv))
        print(f"total wall time {time.perf_counter() - started:.1f} s")
        return code
    except ValueError as exc:
        print(f"aserve sim: error: {exc}")
        return 2
