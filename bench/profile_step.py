"""Where one engine step's time goes: `torch.profiler` over `ModelRunner.execute_sync` for a
decode step, a prefill and a mixed step at several batch sizes, split into linear layers, LM head,
attention, sampler, metadata and the rest (embeddings, LayerNorms, residual adds, Python).

    python -m bench.profile_step --model opt-125m --dtype bfloat16 --context 128

Labels come from record_function ranges this script wraps around the pieces (module hooks on
the linear layers, wrappers around the attention backend's call, the runner's metadata
build, LM head and sampler); the engine itself carries no profiling code. Prints a Markdown
table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

import aserve.engine.runner as runner_module
from aserve.engine.config import ModelConfig
from aserve.engine.runner import ModelRunner, PenaltySettings, WorkItem
from models import cpu_isa
from models.cpu_kernels import advise_huge_pages
from models.loader import resolve_dtype
from models.opt import PACKED_LINEARS, HalfLinear

BLOCK_SIZE = 16  # tokens per KV block
PARTS = ("linear", "lm_head", "attention", "sampler", "metadata")  # labelled ranges
COPY_OPS = ("aten::copy_", "aten::index_copy_", "aten::clone", "aten::cat", "aten::contiguous")


def work(batch: int, context: int, phase: str, vocab: int, penalties: bool = False
         ) -> tuple[list[WorkItem], int]:
    """`batch` sequences of `context` cached tokens taking one decode token each (decode),
    `batch` prompts of `context` tokens (prefill), or the decode batch beside one prompt of
    `context` tokens (mixed: a continuous-batching step); returns the items and the KV
    blocks they need.
    With `penalties`, every sequence asks for presence, frequency and repetition penalties
    over its `context` tokens (the last eighth of them its output)."""
    per_seq = -(-(context + 1) // BLOCK_SIZE)
    items = []
    for i in range(batch + (phase == "mixed")):
        table = list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))
        seen = [(7 * i + 13 * j * j) % (vocab - 4) + 4 for j in range(context + 1)]
        prompt = phase == "prefill" or i == batch  # a mixed step's last item is its prompt
        ids = seen[:context] if prompt else seen[-1:]
        start = 0 if prompt else context
        settings = (PenaltySettings(0.5, 0.5, 1.1, (), seen, context - context // 8)
                    if penalties else None)
        items.append(WorkItem(ids, start, table, True, 0.0, 1.0, -1, None, 0, settings))
    return items, 1 + len(items) * per_seq


def grow(items: list[WorkItem]) -> None:
    """Appends a token to each penalised sequence, as a decode step's output would."""
    for item in items:
        if item.penalties is not None:
            tokens = item.penalties.token_ids
            assert isinstance(tokens, list)
            tokens.append(tokens[-1])


@contextmanager
def labelled(runner: ModelRunner) -> Iterator[None]:
    """Puts record_function ranges around the linear layers, attention modules, LM head,
    sampler and metadata build of `runner` for the duration of the block."""
    ranges: dict[int, Any] = {}

    def enter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, *args: object) -> None:
            ranges[id(module)] = record_function(name).__enter__()
        return hook

    def leave(module: nn.Module, *args: object) -> None:
        ranges.pop(id(module)).__exit__(None, None, None)

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with record_function(name):
                return fn(*args, **kwargs)
        return wrapped

    handles, gated = [], []
    for module in runner.model.modules():
        if isinstance(module, (nn.Linear, *PACKED_LINEARS)):
            handles.append(module.register_forward_pre_hook(enter("linear")))
            handles.append(module.register_forward_hook(leave))
        if isinstance(module, HalfLinear):  # its fused gate/up GEMMs run outside forward
            module.silu_mul = wrap("linear", module.silu_mul)  # type: ignore[method-assign]
            gated.append(module)
    saved = (runner._prepare, runner.model.compute_logits, runner_module.sample)
    # the attention backend's call (KV write included), whatever the model family
    runner.backend.attend = wrap("attention", runner.backend.attend)  # type: ignore[method-assign]
    runner._prepare = wrap("metadata", runner._prepare)  # type: ignore[method-assign]
    runner.model.compute_logits = wrap("lm_head", runner.model.compute_logits)  # type: ignore
    runner_module.sample = wrap("sampler", runner_module.sample)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        del runner.backend.attend  # the class's method again
        for module in gated:
            del module.silu_mul
        runner._prepare, runner.model.compute_logits, runner_module.sample = saved  # type: ignore


def split(prof: profile, wall_ms: float) -> dict[str, float]:
    """Milliseconds per part; attention excludes the linear layers it calls; `copies` is the
    self time of copy ops wherever they ran (already counted in some part)."""
    total: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.name in PARTS:
            total[event.name] += event.cpu_time_total / 1e3
        if event.name in COPY_OPS:
            total["copies"] += event.self_cpu_time_total / 1e3
    linear_in_attention = sum(
        e.cpu_time_total for e in prof.events()
        if e.name == "linear" and e.cpu_parent is not None and e.cpu_parent.name == "attention")
    total["attention"] -= linear_in_attention / 1e3
    total["other"] = wall_ms - sum(total[p] for p in PARTS)
    return dict(total)


def profile_step(runner: ModelRunner, batch: int, context: int, phase: str,
                 repeats: int, penalties: bool = False, dtype: str = "bfloat16"
                 ) -> tuple[float, dict[str, float]]:
    """Median wall ms of `repeats` steps over a KV cache of `dtype`, and the split of one
    profiled step."""
    items, num_blocks = work(batch, context, phase, runner.model_config.vocab_size,
                             penalties)
    cfg = runner.model_config
    # NOTE: on huge pages where Linux has them, as the engine allocates its KV cache
    kv = torch.empty(num_blocks, cfg.num_layers, 2, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                     dtype=resolve_dtype(dtype))
    advise_huge_pages(kv)
    kv.copy_(torch.randn(kv.shape))
    runner.execute_sync(items, kv)
    times = []
    for _ in range(repeats):
        grow(items)
        start = time.perf_counter()
        runner.execute_sync(items, kv)
        times.append((time.perf_counter() - start) * 1e3)
    with labelled(runner), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        runner.execute_sync(items, kv)
        wall = (time.perf_counter() - start) * 1e3
    parts = split(prof, wall)
    return statistics.median(times), {k: v * 100 / wall for k, v in parts.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__)
    p.add_argument("--model", default="opt-125m", help="preset or checkpoint (default opt-125m)")
    p.add_argument("--dtype", default="bfloat16", help="default bfloat16")
    p.add_argument("--context", type=int, default=128,
                   help="cached tokens per decode sequence, prompt tokens per prefill "
                        "(default 128)")
    p.add_argument("--batches", default="1,16,64", help="batch sizes (default 1,16,64)")
    p.add_argument("--phases", default="decode,prefill",
                   help="decode, prefill and/or mixed (the decode batch beside one prompt of "
                        "--context tokens); default decode,prefill")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per row (default 5)")
    p.add_argument("--native-half-matmuls", action="store_true",
                   help="keep torch's bf16/fp16 GEMM even where the runner would compute the "
                        "matmuls in float32 (an engine without the float32 path; default off)")
    p.add_argument("--penalties", action="store_true",
                   help="each row also with presence, frequency and repetition penalties "
                        "on every sequence (phase shown as PHASE+penalties)")
    args = p.parse_args(argv)
    if args.native_half_matmuls:
        runner_module.fit_matmuls_to = lambda model, device: False
    runner = ModelRunner(ModelConfig(model=args.model, dtype=args.dtype), torch.device("cpu"),
                         BLOCK_SIZE)
    print(f"{args.model} {args.dtype}, context {args.context}, {torch.get_num_threads()} "
          f"threads, {cpu_isa.describe()}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| phase | batch | step ms (median) | " + " | ".join(f"{p} %" for p in PARTS)
          + " | other % | copies % |")
    print("|---" * (len(PARTS) + 5) + "|")
    for phase in args.phases.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for penalties in (False, True) if args.penalties else (False,):
                # in the runner's thread, as the engine runs steps (OpenMP's teams, runner.py)
                ms, parts = runner.executor.submit(
                    profile_step, runner, batch, args.context, phase, args.repeats, penalties,
                    args.dtype).result()
                cells = " | ".join(f"{parts.get(k, 0.0):.0f}"
                                   for k in (*PARTS, "other", "copies"))
                label = f"{phase}+penalties" if penalties else phase
                print(f"| {label} | {batch} | {ms:.1f} | {cells} |", flush=True)
    runner.shutdown()


if __name__ == "__main__":
    main()
