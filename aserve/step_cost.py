"""The engine's step-cost model, which the cost-aware policy (`aligned`) decides with.

One model for both drivers: sim/cost.py's ``CostModel`` (weights, per-sequence overheads
and the attention work of the backend: padded, per-sequence waves, split-K) of this
engine's OPT geometry on its decode device, its constants fitted by sim/calibrate.py to a
short probe at start-up (synthetic decode steps of chosen lengths and batch sizes, ``probe``;
run under every policy, as they are also the iteration logs' calibration rows), then
refitted to the engine's own decode iteration records as they accumulate, where that fits
them better than the probe's constants do; the refits keep the probe's imbalance weight.

NOTE: the records alone are a poor start: a policy that keeps batches aligned records few
steps whose lengths differ, so the weight of imbalance cannot be told from them (a fit to
`aligned`'s own records on the shared CPU put it at 0, and the policy then mixed lengths).
The probe's steps differ by design.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Mapping, Sequence

import torch

from aserve.core import IterationRecord
from aserve.runner import ModelRunner, WorkItem
from models.llama import LlamaConfig
from models.opt import OPTConfig
from scheduler import ceil_div
from sim.calibrate import ATTENTION_KERNELS, fit, record_lengths
from sim.cost import CostModel, GrowingDecodeStep, ModelGeometry
from sim.hardware import HARDWARE, get_hardware

FIRST_FIT = 32  # decode iterations recorded before the constants are first refitted
REFIT_GROWTH = 4  # then refitted each time the records have grown this many times
PROBE_BATCH = 8  # seqs per probe step (at most the engine's max_batch_size)
PROBE_LONGEST = 512  # KV tokens of the probe's longest seq (less if the cache is small)
# NOTE: each probe step runs this many times and the fastest counts. With 2, six start-ups
# of one engine (opt-125m bf16, padded, shared 2-core CPU) fitted an imbalance weight of
# 3.8-6.5, and two benchmark runs minutes apart made different padded decisions (519 and
# 640 decode steps); with 6, 4.5-4.9 (benchmarks/RESULTS.md §22). The refits keep that weight.
PROBE_REPEATS = 6


def hardware_name(device: str) -> str:
    """The hardware table's entry for a torch device ("cpu", "cuda:N"): a GPU by its name
    (an H100 where the table has no such GPU)."""
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    return next((key for key in HARDWARE if key != "cpu" and key in name), "h100")


class EngineStepCost:
    """``step_time(lengths)`` for one decode device, refitted from ``records`` (the
    engine's iteration records, a list the engine keeps appending to)."""

    def __init__(self, model: OPTConfig | LlamaConfig, attention: str, device: str,
                 dtype_bytes: int, records: list[IterationRecord],
                 probed: Sequence[IterationRecord | Mapping[str, object]] = ()) -> None:
        geometry = ModelGeometry(
            "engine", model.num_layers, model.hidden_size, model.num_heads, model.ffn_dim,
            vocab_size=model.vocab_size, embed_dim=model.word_embed_proj_dim,
            num_kv_heads=model.num_kv_heads)
        if isinstance(model, LlamaConfig):  # rotary positions, a gated MLP, maybe an LM head
            geometry = dataclasses.replace(geometry, gated_mlp=True, num_positions=0,
                                           tied_embeddings=model.tie_word_embeddings)
        self.geometry = geometry
        self.kernel = ATTENTION_KERNELS[attention]
        self.hardware = dataclasses.replace(get_hardware(hardware_name(device)),
                                            dtype_bytes=dtype_bytes)
        self.model = CostModel(self.geometry, self.hardware, kernel=self.kernel)
        self.records = records
        self.next_fit = FIRST_FIT
        self.num_fits = 0
        self.probed = [dataclasses.asdict(r) if isinstance(r, IterationRecord) else r
                       for r in probed] if len(probed) >= 3 else []
        # the imbalance weight the probe measured, which refits keep (`refit`)
        self.imbalance_weight: float | None = None
        if self.probed:
            self.model = self._fitted(self.probed)
            self.imbalance_weight = self.model.params.imbalance_weight
            self.num_fits += 1

    def __call__(self, lengths: Sequence[int]) -> float:
        if len(self.records) >= self.next_fit:
            self.refit()
        return self.model.iteration_time(lengths)

    def decode_step(self, lengths: Sequence[int]) -> GrowingDecodeStep:
        """The step over ``lengths`` grown one seq at a time (scheduler/cost.py
        ``growing_step``), on the model ``__call__`` would use."""
        if len(self.records) >= self.next_fit:
            self.refit()
        return self.model.decode_step(lengths)

    def refit(self) -> None:
        """Fits the constants to the decode records so far (pure decode steps only) and the
        probe's steps, which weigh as much as the records in all, keeping the imbalance
        weight the probe measured.

        NOTE: benchmarks/RESULTS.md §18 and §21. Fitted to its records alone, a padded
        `aligned` run (64 requests) replaced the probe's imbalance weight (2.8) by 0 at its
        128th record, as the module's docstring warns: its aligned steps cannot tell
        imbalance from per-seq overhead. It then mixed lengths and paid 475 padded KV tokens
        per generated token instead of 367 (59.5 against 66.8 tok/s). With the probe's steps
        in the fit, a noisy spell still halved it at the 32nd record (`imbalance_weight` 3.2
        against the probe's 5.8) and the run paid 482 instead of 380.
        The probe's steps differ in length by design and measure that weight; the records
        refine the rest."""
        rows = [dataclasses.asdict(r) for r in self.records
                if r.instance.startswith("decode") and r.num_prefill_tokens == 0]
        self.next_fit = max(len(self.records), 1) * REFIT_GROWTH
        if len(rows) < FIRST_FIT // 2:
            return
        probed = self.probed * (len(rows) // len(self.probed)) if self.probed else []
        refitted = self._fitted(rows + probed)
        if relative_error(refitted, rows) < relative_error(self.model, rows):
            self.model = refitted
            self.num_fits += 1

    def _fitted(self, rows: Sequence[Mapping[str, object]]) -> CostModel:
        calibration = fit(rows, self.geometry, self.hardware.name, self.kernel,
                          self.hardware.dtype_bytes, self.imbalance_weight)
        return CostModel(self.geometry, self.hardware, calibration.params, self.kernel)


def relative_error(model: CostModel, rows: Sequence[Mapping[str, object]]) -> float:
    """The median relative error of ``model``'s step times over iteration records."""
    timed = [(r, t) for r in rows
             if isinstance(t := r["forward_time"], (int, float)) and t > 0]
    errors = [abs(model.iteration_time(*record_lengths(r)) / t - 1) for r, t in timed]
    return statistics.median(errors) if errors else math.inf


def probe(runner: ModelRunner, kv_cache: torch.Tensor, num_blocks: int, block_size: int,
          max_len: int, max_batch_size: int) -> list[IterationRecord]:
    """Times synthetic decode steps on ``runner`` (call it in the runner's thread, before
    the engine serves: it writes KV into free blocks of ``kv_cache``, never block 0, the
    padding block): a batch of short seqs, of medium ones, of long ones, one long seq
    alone, and short seqs with one long one; then batches of short and of medium seqs
    doubling in size up to ``max_batch_size`` (as many as the cache holds). Returns them as
    iteration records of instance "probe"; [] when the cache is too small to probe.

    NOTE: the size sweep is what a fit needs to price a large batch: fitted to records of at
    most 25 seqs, sim/calibrate.py's per-seq term priced Azure conv's steps of 32-45 seqs at
    1.15-1.29x their time (benchmarks/RESULTS.md §20). A fit of both workloads' records
    together is within 5 % at every size, so the model's form is not what was missing."""
    n = max(2, min(PROBE_BATCH, max_batch_size))
    longest = min(PROBE_LONGEST, max_len - 2, (num_blocks - 1) // n * block_size - 1)
    if longest < 16:
        return []
    short, mid = longest // 16, longest // 4
    batches = [[short] * n, [mid] * n, [longest] * n, [longest], [short] * (n - 1) + [longest]]
    size = 2 * n
    while size <= max_batch_size:
        for length in (short, mid):
            fits = (num_blocks - 1) // ceil_div(length + 1, block_size)  # seqs it holds
            if fits >= size:
                batches.append([length] * size)
        size *= 2
    return [_timed_step(runner, kv_cache, cached, block_size) for cached in batches]


def _timed_step(runner: ModelRunner, kv_cache: torch.Tensor, cached: list[int],
                block_size: int) -> IterationRecord:
    """One synthetic decode step over seqs of ``cached`` KV tokens, the fastest of
    PROBE_REPEATS runs."""
    items, first = [], 1
    for i, length in enumerate(cached):
        blocks = ceil_div(length + 1, block_size)
        items.append(WorkItem([4 + i % 16], length, list(range(first, first + blocks)),
                              True, 0.0, 1.0, -1, None, 0))
        first += blocks
    times, began = [], time.perf_counter()
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        runner.execute_sync(items, kv_cache)
        times.append(time.perf_counter() - start)
    lengths = tuple(length + 1 for length in cached)
    return IterationRecord("probe", began, len(cached), 0, min(lengths), max(lengths),
                           min(times), 0.0, False, {}, lengths, (1,) * len(lengths))
