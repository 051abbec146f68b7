"""bench/step_grid.py: decode steps timed over a grid, written as records the fit reads."""

from __future__ import annotations

from pathlib import Path

from bench.step_grid import BLOCK_SIZE, MAX_BLOCKS, grid, main
from scheduler import ceil_div
from scheduler.calibrate import fit, load_records


def test_the_grid_keeps_uniform_steps_to_the_blocks_and_mixes_lengths() -> None:
    steps = grid(max_blocks=2_000)
    uniform = [s for s in steps if len(set(s)) == 1]
    assert {len(s) for s in uniform} >= {1, 96} and {s[0] for s in uniform} >= {64, 2000}
    assert all(len(s) * ceil_div(s[0] + 1, BLOCK_SIZE) <= 2_000 for s in uniform)
    assert [2000] * 96 not in steps and [64] * 96 in steps
    assert any(len(set(s)) > 1 for s in steps)


def test_the_records_fit_a_padded_cost(tmp_path: Path) -> None:
    out = tmp_path / "grid.jsonl"
    main(["--model", "opt-tiny", "--dtype", "float32", "--attention", "padded",
          "--out", str(out)])
    header, records = load_records(out)
    assert header["attention"] == "padded" and header["hardware"] == "cpu"
    assert len(records) == len(grid(MAX_BLOCKS))
    assert all(float(r["forward_time"]) > 0 and r["instance"] == "probe"  # type: ignore[arg-type]
               for r in records)
    assert fit(records, model="opt-125m", kernel="padded").num_records == len(records)
