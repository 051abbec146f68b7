"""The engine's step-cost model, which the cost-aware policy (`aligned`) decides with.

One model for both drivers: scheduler/cost_model.py's ``CostModel`` (weights, per-sequence overheads
and the attention work of the backend: padded, per-sequence waves, split-K) of this
engine's geometry on its decode device, its constants fitted by scheduler/calibrate.py to a
short probe at start-up (synthetic decode steps of chosen lengths and batch sizes, ``probe``;
run under every policy, as they are also the iteration logs' calibration rows).

The constants are fitted once per machine, backend, geometry, dtype and probe, and cached
(``cache_dir``): every later start-up on the same machine reads them, so one workload makes
the same decisions on every run, whatever the timing noise of the run or of its probe. They
are never refitted to the run's own records: those follow the run's noise (two runs of one
workload then decide differently), and a policy that keeps batches aligned records few steps
whose lengths differ, from which the weight of imbalance cannot be told. The probe's steps
differ by design.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

import models
from aserve import __version__
from aserve.engine.runner import ModelRunner, WorkItem
from aserve.engine.sequence import IterationRecord
from models import cpu_isa
from models.backends import ATTENTION_KERNELS
from models.llama import LlamaConfig
from models.opt import OPTConfig
from scheduler import ceil_div
from scheduler.calibrate import fit
from scheduler.cost_model import (
    CostModel,
    CostParams,
    GrowingDecodeStep,
    ModelGeometry,
    kernel_kind,
)
from scheduler.hardware import HARDWARE, get_hardware

logger = logging.getLogger(__name__)

PROBE_BATCH = 8  # seqs per probe step (at most the engine's max_batch_size)
PROBE_LONGEST = 512  # KV tokens of the probe's longest seq (less if the cache is small)
# NOTE: the probe runs its steps in this many rounds, each step once per round, and each
# step's fastest run counts: a spell of interference from another process then slows one
# round of every step, not every run of one step, and the fastest is the machine's own.
PROBE_ROUNDS = 6
CACHE_ENV = "ASERVE_STEP_COST_CACHE"  # folder of cached calibrations; "off": no cache


def hardware_name(device: str) -> str:
    """The hardware table's entry for a torch device ("cpu", "cuda:N"): a GPU by its name
    (an H100 where the table has no such GPU)."""
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    return next((key for key in HARDWARE if key != "cpu" and key in name), "h100")


def cache_dir() -> Path | None:
    """Where calibrations are cached: ``$ASERVE_STEP_COST_CACHE`` ("off": nowhere), else
    aserve/step-cost under ``$XDG_CACHE_HOME`` (default ~/.cache)."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "off") else Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "aserve" / "step-cost"


def machine(device: str) -> dict[str, object]:
    """What the step times of ``device`` depend on besides the model: the processor (on a
    CPU with the instruction sets its kernels use: one model name can cover CPUs with and
    without AVX-512), the threads torch uses, torch's version, this package's, and the
    source of its model code (a kernel changed within one version times steps anew)."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines()
                     if line.startswith("model name")), platform.processor() or "cpu")
        name = f"{name}, {cpu_isa.describe()}"
    return {"device": name, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "aserve": __version__, "models": models_fingerprint()}


@functools.cache
def models_fingerprint() -> str:
    """A digest of the `models` package's source: its kernels and layers."""
    digest = hashlib.sha256()
    for path in sorted(Path(models.__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


class EngineStepCost:
    """``step_time(lengths)`` for one decode device: the cost model with the constants of
    the calibration cached for this machine and probe, else fitted to ``probed`` (and
    cached); the priors when there is no probe."""

    def __init__(self, model: OPTConfig | LlamaConfig, attention: str, device: str,
                 dtype_bytes: int,
                 probed: Sequence[IterationRecord | Mapping[str, object]] = (),
                 cache: Path | None = None) -> None:
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
        self.source = "priors"  # or "probe" (fitted now) or the cached file's path
        rows = [dataclasses.asdict(r) if isinstance(r, IterationRecord) else dict(r)
                for r in probed]
        if len(rows) < 3:
            return
        key = {"machine": machine(device), "attention": attention, "kernel": self.kernel,
               "dtype_bytes": dtype_bytes, "geometry": dataclasses.asdict(geometry),
               "probe": [list(r["lengths"]) for r in rows]}  # type: ignore[arg-type]
        path = None if cache is None else cache / f"{_digest(key)}.json"
        params = _read(path, key)
        if params is None:
            params = fit(rows, geometry, self.hardware.name, self.kernel, dtype_bytes).params
            _write(path, key, params)
            self.source = "probe"
        else:
            self.source = str(path)
        self.model = CostModel(self.geometry, self.hardware, params, self.kernel)

    def __call__(self, lengths: Sequence[int]) -> float:
        return self.model.iteration_time(lengths)

    def decode_step(self, lengths: Sequence[int]) -> GrowingDecodeStep:
        """The step over ``lengths`` grown one seq at a time (scheduler/step_time.py
        ``growing_step``), on the model ``__call__`` uses."""
        return self.model.decode_step(lengths)


def _digest(key: Mapping[str, object]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _read(path: Path | None, key: Mapping[str, object]) -> CostParams | None:
    """The cached constants for ``key``; None when there are none (or the file is not a
    calibration of this key: it is then refitted and rewritten)."""
    if path is None or not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc.get("key") != json.loads(json.dumps(key)):
            return None
        return CostParams(**doc["params"])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        logger.warning("step-cost cache %s unreadable (%s): refitting", path, exc)
        return None


def _write(path: Path | None, key: Mapping[str, object], params: CostParams) -> None:
    """Caches ``params`` for ``key`` (atomically); a cache that cannot be written is left
    out with a warning: the engine serves with the constants it fitted."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "params": dataclasses.asdict(params)},
                                  indent=1) + "\n")
        tmp.replace(path)
    except OSError as exc:
        logger.warning("step-cost cache %s not written (%s)", path, exc)


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
    return timed_steps(runner, kv_cache, batches, block_size)


def timed_steps(runner: ModelRunner, kv_cache: torch.Tensor, batches: list[list[int]],
                 block_size: int) -> list[IterationRecord]:
    """One synthetic decode step over seqs of each batch's KV tokens, run in
    ``PROBE_ROUNDS`` rounds; each step's fastest run (the runner's own measure) counts."""
    steps = []
    for cached in batches:
        items, first = [], 1
        for i, length in enumerate(cached):
            blocks = ceil_div(length + 1, block_size)
            items.append(WorkItem([4 + i % 16], length, list(range(first, first + blocks)),
                                  True, 0.0, 1.0, -1, None, 0))
            first += blocks
        steps.append(items)
    times: list[list[float]] = [[] for _ in batches]
    began = time.perf_counter()
    for _ in range(PROBE_ROUNDS):
        for items, timed in zip(steps, times):
            timed.append(runner.execute_sync(items, kv_cache).forward_time)
    records = []
    for cached, timed in zip(batches, times):
        lengths = tuple(length + 1 for length in cached)
        records.append(IterationRecord("probe", began, len(cached), 0, min(lengths),
                                       max(lengths), min(timed), 0.0, False, {}, lengths,
                                       (1,) * len(lengths)))
    return records
