"""A split-K backlog's tail in the simulator (scheduler/aligned.py, ``_swap``): evicted seqs
swap in for running ones once they have waited ``SWAP_STEPS`` boundaries, every request
finishes, every block is freed, and no seq is swapped out again before it has made
``SWAP_STEPS`` tokens since it joined."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.family import sample_family
from scheduler import aligned
from scheduler.cost_model import CostModel, get_geometry
from scheduler.hardware import get_hardware
from sim import ClusterConfig, simulate

BLOCK_SIZE = 16


def _run(seed: int, member: int) -> tuple[object, object]:
    m = sample_family(member + 1, seed, max_len=2048)[member]
    each = sorted(-(-(r.prompt_len + r.output_len) // BLOCK_SIZE) for r in m.workload.requests)
    decode = m.num_decode_blocks(BLOCK_SIZE)
    batch = max(1, decode // each[len(each) // 2])  # what decode KV holds of median requests
    config = ClusterConfig.create(block_size=BLOCK_SIZE, num_decode_blocks=decode,
                                  num_prefill_blocks=2 * sum(each), num_staging_blocks=2 * decode,
                                  num_host_blocks=2 * sum(each), max_batch_size=2 * batch,
                                  min_requests=batch)
    cost = CostModel(get_geometry("opt-125m"), get_hardware("cpu"), kernel="split-k")
    return m, simulate(m.workload, "aligned", config, cost)


@pytest.mark.parametrize(("seed", "member"), [(0, 1), (1, 5), (2, 4)])
def test_swaps_finish_everything_and_free_every_block(seed: int, member: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    m, result = _run(seed, member)
    assert result.num_finished == result.num_requests  # type: ignore[attr-defined]
    assert all(n == 0 for n in result.blocks_left.values())  # type: ignore[attr-defined]
    events = sorted(result.events, key=lambda e: e.time)  # type: ignore[attr-defined]
    outputs = {r.request_id: r.output_len for r in m.workload.requests}  # type: ignore[attr-defined]
    evictions = Counter(e.seq_id for e in events if e.kind == "evicted")
    # each swap-out follows SWAP_STEPS tokens since the seq joined; plain evictions take
    # the latest arrivals, at most one per admission
    assert all(n <= outputs[s] // aligned.SWAP_STEPS + 2 for s, n in evictions.items())
    monkeypatch.setattr(aligned, "SWAP_STEPS", 10**9)
    _, unswapped = _run(seed, member)
    assert unswapped.num_finished == unswapped.num_requests  # type: ignore[attr-defined]
    swapped = sum(evictions.values())
    assert swapped > sum(1 for e in unswapped.events if e.kind == "evicted")  # type: ignore[attr-defined]
