"""`row_blocks.by_rows`: a prompt-sized product runs whole or in blocks of rows, whichever
it measured faster for its weight and row count, with the same result either way."""

from __future__ import annotations

import time

import pytest
import torch
from torch import Tensor

from models import row_blocks
from models.row_blocks import ROW_BLOCK


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(row_blocks, "_plans", {})


def counted(per_call_s: float, per_row_s: float, weight: Tensor, calls: list[int]):  # type: ignore[no-untyped-def]
    """A product `x @ weight` that takes a fixed time per call and more for each row
    beyond ROW_BLOCK (like a GEMM that slows down past some row count)."""
    def product(x: Tensor, other: Tensor) -> Tensor:
        calls.append(x.shape[0])
        time.sleep(per_call_s + per_row_s * max(0, x.shape[0] - ROW_BLOCK))
        return x @ weight + other
    return product


def test_blocks_where_whole_products_are_slower_and_whole_where_calls_cost_more() -> None:
    weight = torch.randn(8, 4, dtype=torch.float64)
    x = torch.randn(4 * ROW_BLOCK + 3, 8, dtype=torch.float64)
    other = torch.randn(x.shape[0], 4, dtype=torch.float64)
    slow_rows: list[int] = []
    out = row_blocks.by_rows("slow rows", counted(0.0, 1e-5, weight, slow_rows), x, other)
    torch.testing.assert_close(out, x @ weight + other)  # both operands split alike
    assert row_blocks.plans() == {("slow rows", 4): True}
    slow_rows.clear()
    torch.testing.assert_close(row_blocks.by_rows(
        "slow rows", counted(0.0, 1e-5, weight, slow_rows), x, other), x @ weight + other)
    assert slow_rows == [ROW_BLOCK] * 4 + [3]  # the bucket keeps its choice, unmeasured

    costly_calls: list[int] = []
    row_blocks.by_rows("costly calls", counted(2e-3, 0.0, weight, costly_calls), x, other)
    assert row_blocks.plans()[("costly calls", 4)] is False
    costly_calls.clear()
    row_blocks.by_rows("costly calls", counted(2e-3, 0.0, weight, costly_calls), x, other)
    assert costly_calls == [x.shape[0]]


def test_products_under_two_blocks_run_whole_unmeasured() -> None:
    weight = torch.randn(8, 4)
    x, calls = torch.randn(2 * ROW_BLOCK - 1, 8), []  # type: ignore[var-annotated]
    row_blocks.by_rows("short", counted(0.0, 1e-5, weight, calls), x, torch.zeros(len(x), 4))
    assert calls == [len(x)] and row_blocks.plans() == {}
