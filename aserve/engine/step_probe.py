"""The engine's step-cost model, which the cost-aware policy (`aligned`) decides with.

One model for both drivers: scheduler/cost_model.py's ``CostModel`` (weights, per-sequence overheads
and the attention work of the backend: padded, per-sequence waves, split-K) of this
engine's OPT geometry on its decode device, its constants fitted by scheduler/calibrate.py to a
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
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from aserve.engine.runner import ModelRunner, WorkItem
from aserve.engine.sequence import IterationRecord
from models.backends import ATTENTION_KERNELS
from models.llama import LlamaConfig
from models.opt import OPTConfig
from scheduler import ceil_div
from scheduler.calibrate import fit, record_lengths
from scheduler.cost_model import CostModel, GrowingDecodeStep, ModelGeometry, kernel_kind
from scheduler.hardware import HARDWARE, get_hardware

FIRST_FIT = 32  # decode iterations recorded before the constants are first refitted
REFIT_GROWTH = 4  # then refitted each time the records have grown this many times...
# ...up to this many, the most recent records a refit fits; then refitted every this many
# new records. A fit's cost grows with its rows: a window keeps it bounded however long the
# server runs, and the fit runs on a worker thread, never on the event loop.
REFIT_WINDOW = 4096
PROBE_BATCH = 8  # seqs per probe step (at most the engine's max_batch_size)
PROBE_LONGEST = 512  # KV tokens of the probe's longest seq (less if the cache is small)
# NOTE: each probe step runs this many times and the fastest counts: with fewer, start-ups
# on a shared CPU fit imbalance weights far apart, and two runs of one benchmark make
# different decisions. The refits keep the probe's weight.
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
    engine's iteration records, a list the engine keeps appending to and trims) on a worker
    thread; a refit's model is taken at the first call after it is done."""

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
        self.kernel = kernel_kind(ATTENTION_KERNELS[attention])
        self.hardware = dataclasses.replace(get_hardware(hardware_name(device)),
                                            dtype_bytes=dtype_bytes)
        self.model = CostModel(self.geometry, self.hardware, kernel=self.kernel)
        self.records = records
        self.next_fit = FIRST_FIT
        self.num_fits = 0
        self._num_at_fit = 0  # len(records) at the last refit (the engine trims old ones)
        self._fitting: Future[CostModel | None] | None = None  # a refit on the worker thread
        self._executor: ThreadPoolExecutor | None = None  # made at the first refit
        self.probed = [dataclasses.asdict(r) if isinstance(r, IterationRecord) else r
                       for r in probed] if len(probed) >= 3 else []
        # the imbalance weight the probe measured, which refits keep (`refit`)
        self.imbalance_weight: float | None = None
        if self.probed:
            self.model = self._fitted(self.probed)
            self.imbalance_weight = self.model.params.imbalance_weight
            self.num_fits += 1

    def __call__(self, lengths: Sequence[int]) -> float:
        self._refresh()
        return self.model.iteration_time(lengths)

    def decode_step(self, lengths: Sequence[int]) -> GrowingDecodeStep:
        """The step over ``lengths`` grown one seq at a time (scheduler/step_time.py
        ``growing_step``), on the model ``__call__`` would use."""
        self._refresh()
        return self.model.decode_step(lengths)

    def _refresh(self) -> None:
        """Takes a finished background refit's model, and starts the next refit once due
        (on a snapshot of the window: the worker never reads the list the engine appends
        to)."""
        if self._fitting is not None:
            if not self._fitting.done():
                return
            refitted, self._fitting = self._fitting.result(), None
            if refitted is not None:
                self.model = refitted
                self.num_fits += 1
        num = len(self.records)
        if num < self.next_fit and num >= self._num_at_fit:
            return
        self._schedule_next(num)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aserve-refit")
        self._fitting = self._executor.submit(self._refitted, self.records[-REFIT_WINDOW:])

    def _schedule_next(self, num: int) -> None:
        self._num_at_fit = num
        self.next_fit = min(max(num, 1) * REFIT_GROWTH, num + REFIT_WINDOW)

    def refit(self) -> None:
        """Refits now, in this thread (`_refitted`)."""
        self._schedule_next(len(self.records))
        refitted = self._refitted(self.records[-REFIT_WINDOW:])
        if refitted is not None:
            self.model = refitted
            self.num_fits += 1

    def _refitted(self, records: Sequence[IterationRecord]) -> CostModel | None:
        """Fits the constants to the decode `records` (pure decode steps only) and the
        probe's steps, which weigh as much as the records in all, keeping the imbalance
        weight the probe measured.

        NOTE: fitted to its records alone, a padded `aligned` run loses the imbalance weight
        (its aligned steps cannot tell imbalance from per-seq overhead, as the module's
        docstring warns), then mixes lengths and pays for padding; even with the probe's
        steps in the fit a noisy spell can halve it. The probe's steps differ in length by
        design and measure that weight; the records refine the rest."""
        rows = [dataclasses.asdict(r) for r in records
                if r.instance.startswith("decode") and r.num_prefill_tokens == 0]
        if len(rows) < FIRST_FIT // 2:
            return None
        probed = self.probed * (len(rows) // len(self.probed)) if self.probed else []
        refitted = self._fitted(rows + probed)
        current = self.model  # NOTE: read once; only the loop's thread replaces it
        is_better = relative_error(refitted, rows) < relative_error(current, rows)
        return refitted if is_better else None

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

    NOTE: the size sweep is what a fit needs to price a large batch: fitted to records of
    small batches only, the per-seq term overprices larger ones, while a fit over all sizes
    holds at every size, so the model's form is not what was missing."""
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
