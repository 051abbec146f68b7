"""Prompt-sized half-precision GEMMs in blocks of rows, where that measures faster.

oneDNN chooses how to split a GEMM over the threads from its shape alone, and on some CPUs
whole ranges of row counts run at about half the rate of fewer or more rows (on an AMX
Xeon with 2 threads, prompts of 512-1,280 tokens through OPT's and SmolLM2's narrow
output layers; docs/results-cpu.md). Which row counts, for which weights, depends on the
CPU, oneDNN's version and the thread count, so it is measured where it happens: the
first product of each weight shape, operation and bucket of `ROW_BLOCK` rows runs whole
and in blocks of `ROW_BLOCK` rows, `TRIALS` times each, alternating, and the faster
(blocks only by a margin, `MARGIN`) serves that bucket for the life of the process.

The two differ in the last bit of some outputs (another kernel sums in another order), as
a product over another batch's row count already does; within a process a bucket keeps
its choice, so the same step gives the same outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from models import measure

ROW_BLOCK = 256  # rows per block; products over fewer than 2 blocks always run whole
TRIALS = 3  # timed runs of each way, per bucket
MARGIN = 0.9  # blocks are kept only if at most this share of the whole product's time

# (weight shape and operation, rows // ROW_BLOCK) -> whether blocks are faster
_plans: dict[tuple[object, int], bool] = {}


def by_rows(key: object, product: Callable[..., Tensor], *rows: Tensor) -> Tensor:
    """``product(*rows)``, whose output has a row for each row of every tensor in
    ``rows`` (the input and, for a fused add or product, the other operand), computed
    whole or as ``product`` over blocks of ``ROW_BLOCK`` rows, whichever this process
    measured faster for ``key`` (the weight's shape and the operation) at that many rows.
    """
    num = rows[0].shape[0]
    if num < 2 * ROW_BLOCK:
        return product(*rows)
    bucket = (key, num // ROW_BLOCK)
    split = _plans.get(bucket)
    if split is None:
        split, out = _measure(product, rows)
        _plans[bucket] = split
        return out
    return _in_blocks(product, rows) if split else product(*rows)


def _in_blocks(product: Callable[..., Tensor], rows: tuple[Tensor, ...]) -> Tensor:
    num = rows[0].shape[0]
    return torch.cat([product(*(t[i:i + ROW_BLOCK] for t in rows))
                      for i in range(0, num, ROW_BLOCK)])


def _measure(product: Callable[..., Tensor], rows: tuple[Tensor, ...]) -> tuple[bool, Tensor]:
    """Whether blocks beat the whole product here, and the product computed the way
    chosen."""
    best, outs = measure.best_seconds({"blocks": lambda: _in_blocks(product, rows),
                                       "whole": lambda: product(*rows)}, TRIALS)
    split = best["blocks"] < MARGIN * best["whole"]
    return split, outs["blocks" if split else "whole"]


def plans() -> dict[tuple[object, int], bool]:
    """The choices made so far (for logs and tests)."""
    return dict(_plans)
