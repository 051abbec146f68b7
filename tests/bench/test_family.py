"""The workload family (bench/family.py): members drawn from one seed, within the ranges."""

from __future__ import annotations

import pytest

from bench.family import (
    DECODE_KV_SHARE,
    LONG_RATIO,
    NUM_REQUESTS,
    SHORT_SHARE,
    sample_family,
)


def test_one_seed_gives_the_same_members_and_another_seed_others() -> None:
    first, again, other = (sample_family(6, seed) for seed in (3, 3, 4))
    assert [m.workload for m in first] == [m.workload for m in again]
    assert [m.workload.requests for m in first] != [m.workload.requests for m in other]
    assert len({m.name for m in first}) == 6


def test_members_lie_within_the_family_ranges() -> None:
    for m in sample_family(40, 0, max_len=2040):
        reqs = m.workload.requests
        assert NUM_REQUESTS[0] <= len(reqs) <= NUM_REQUESTS[1]
        assert SHORT_SHARE[0] <= m.short_share <= SHORT_SHARE[1]
        assert LONG_RATIO[0] <= m.long_ratio <= LONG_RATIO[1]
        assert DECODE_KV_SHARE[0] <= m.decode_kv_share <= DECODE_KV_SHARE[1]
        lo, hi = m.output_range
        assert all(lo <= r.output_len <= hi and r.prompt_len + r.output_len <= 2040
                   for r in reqs)
        assert all(r.arrival_time == 0.0 for r in reqs)  # offline
        blocks = [-(-(r.prompt_len + r.output_len) // 16) for r in reqs]
        decode = m.num_decode_blocks(16)
        assert decode >= max(blocks) / 0.9 and decode >= m.decode_kv_share * sum(blocks) - 1


def test_narrowed_ranges_must_lie_within_the_family() -> None:
    small = sample_family(5, 1, num_requests=(32, 36), output_tokens=(32, 40))
    assert all(32 <= m.workload.num_requests <= 36 for m in small)
    with pytest.raises(ValueError, match="num_requests"):
        sample_family(2, 1, num_requests=(8, 36))
    with pytest.raises(ValueError, match="count"):
        sample_family(0, 1)
