"""The engine's step-cost model, which the cost-aware policy (`aligned`) decides with.

One model for both drivers: sim/cost.py's ``CostModel`` (weights, per-sequence overheads
and the attention work of the backend: padded, per-sequence waves, split-K) of this
engine's OPT geometry on its decode device, with its constants fitted by sim/calibrate.py
from the engine's own decode iteration records as they accumulate. Until the first fit the
hardware table's priors stand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from aserve.core import IterationRecord
from models.opt import OPTConfig
from sim.calibrate import ATTENTION_KERNELS, fit
from sim.cost import CostModel, ModelGeometry
from sim.hardware import HARDWARE, get_hardware

FIRST_FIT = 32  # decode iterations recorded before the constants are first fitted
REFIT_GROWTH = 4  # then refitted each time the records have grown this many times


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

    def __init__(self, model: OPTConfig, attention: str, device: str, dtype_bytes: int,
                 records: list[IterationRecord]) -> None:
        self.geometry = ModelGeometry(
            "engine", model.num_layers, model.hidden_size, model.num_heads, model.ffn_dim,
            vocab_size=model.vocab_size, embed_dim=model.word_embed_proj_dim)
        self.kernel = ATTENTION_KERNELS[attention]
        self.hardware = dataclasses.replace(get_hardware(hardware_name(device)),
                                            dtype_bytes=dtype_bytes)
        self.model = CostModel(self.geometry, self.hardware, kernel=self.kernel)
        self.records = records
        self.next_fit = FIRST_FIT
        self.num_fits = 0

    def __call__(self, lengths: Sequence[int]) -> float:
        if len(self.records) >= self.next_fit:
            self.refit()
        return self.model.iteration_time(lengths)

    def refit(self) -> None:
        """Fits the constants to the decode records so far (pure decode steps only)."""
        rows = [dataclasses.asdict(r) for r in self.records
                if r.instance.startswith("decode") and r.num_prefill_tokens == 0]
        self.next_fit = max(len(self.records), 1) * REFIT_GROWTH
        if len(rows) < FIRST_FIT // 2:
            return
        calibration = fit(rows, self.geometry, self.hardware.name, self.kernel,
                          self.hardware.dtype_bytes)
        self.model = CostModel(self.geometry, self.hardware, calibration.params, self.kernel)
        self.num_fits += 1
