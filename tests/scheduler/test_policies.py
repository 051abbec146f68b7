"""Pool-side policy behaviour: registry, FCFS order, starvation control, dynamic prefetch."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from scheduler import (
    POLICIES,
    BoundaryPlan,
    BoundaryView,
    ContinuousPolicy,
    Policy,
    PolicyConfig,
    SeqView,
    StepTime,
    get_policy,
    register_policy,
)

LONG_LENGTH = 6000  # tokens
LONG_BLOCKS = 375  # blocks of 16 tokens
SHORT_BLOCKS = 7  # blocks of a ~100-token request
NUM_SHORT_PER_TICK = 4


def test_builtin_policies_are_registered_with_their_traits() -> None:
    assert {"aligned", "aligned-noprefetch", "fcfs", "continuous"} <= set(POLICIES)
    config = PolicyConfig()
    assert get_policy("aligned", config).uses_dynamic_prefetch
    assert not get_policy("aligned-noprefetch", config).uses_staging
    assert not get_policy("continuous", config).uses_pool


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*aligned.*fcfs"):
        get_policy("nope", PolicyConfig())


def test_research_user_registers_a_policy_without_the_engine() -> None:
    @register_policy
    class Lifo(Policy):
        name = "test-lifo"

        def __init__(self, config: PolicyConfig) -> None:
            super().__init__(config)
            self.ids: list[str] = []

        def add(self, seq: SeqView) -> None:
            self.ids.append(seq.seq_id)

        def remove(self, seq_id: str) -> None:
            self.ids.remove(seq_id)

        def __len__(self) -> int:
            return len(self.ids)

        def __contains__(self, seq_id: object) -> bool:
            return seq_id in self.ids

        def next_batch(self, max_blocks: int, max_requests: int, now: float) -> list[str]:
            return self.ids[::-1][:max_requests]

        def plan_boundary(self, view: BoundaryView) -> BoundaryPlan:
            return BoundaryPlan()

    try:
        policy = get_policy("test-lifo", PolicyConfig())
        policy.add(SeqView("a", 1, 1, 0.0))
        policy.add(SeqView("b", 1, 1, 1.0))
        assert policy.next_batch(10, 1, now=2.0) == ["b"]
        with pytest.raises(ValueError, match="test-lifo"):
            register_policy(type("Other", (Lifo,), {}))
    finally:
        del POLICIES["test-lifo"]


@pytest.mark.parametrize(("field", "value"), [("min_requests", 0), ("leaf_width", 0),
                                              ("max_len", 0), ("starvation_threshold", -1.0),
                                              ("match_slack", -0.1), ("max_spread", 0.9)])
def test_bad_config_names_the_field_and_value(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"{field} \({value}\)"):
        PolicyConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["aligned", "fcfs"])
def test_pool_membership_and_errors(name: str) -> None:
    policy = get_policy(name, PolicyConfig())
    policy.add(SeqView("a", 10, 1, 0.0))
    assert "a" in policy and len(policy) == 1
    with pytest.raises(ValueError, match="'a'"):
        policy.add(SeqView("a", 10, 1, 0.0))
    policy.remove("a")
    with pytest.raises(KeyError, match="'a'"):
        policy.remove("a")
    assert len(policy) == 0


def test_fcfs_takes_oldest_first_and_stops_at_the_first_misfit() -> None:
    policy = get_policy("fcfs", PolicyConfig())
    for seq_id, blocks, arrival in [("c", 2, 3.0), ("a", 5, 1.0), ("b", 9, 2.0), ("d", 1, 4.0)]:
        policy.add(SeqView(seq_id, blocks * 16, blocks, arrival))
    assert policy.next_batch(max_blocks=20, max_requests=10, now=5.0) == ["a", "b", "c", "d"]
    assert policy.next_batch(max_blocks=10, max_requests=10, now=5.0) == ["a"]
    assert policy.next_batch(max_blocks=20, max_requests=2, now=5.0) == ["a", "b"]


def padded_step_time(lengths: Sequence[int]) -> float:
    """A padded backend's step: the weights (worth 4096 KV tokens) plus batch x longest."""
    return 4096.0 + len(lengths) * max(lengths, default=0)


def _starvation_run(threshold: float | None, num_ticks: int,
                    name: str = "aligned-strict") -> int | None:
    """Feed shorts every tick; return the tick whose batch holds the long request.

    `aligned` decides with a padded step cost here: under the default (split-K) cost a
    pool that fits is taken whole, the long request included, which is what pays there.
    """
    policy = get_policy(name, PolicyConfig(min_requests=NUM_SHORT_PER_TICK, max_len=8192,
                                           starvation_threshold=threshold),
                        padded_step_time if name == "aligned" else None)
    policy.add(SeqView("long", LONG_LENGTH, LONG_BLOCKS, arrival_time=0.0))
    for tick in range(1, num_ticks + 1):
        for i in range(NUM_SHORT_PER_TICK):
            policy.add(SeqView(f"s{tick}-{i}", 100 + i, SHORT_BLOCKS, float(tick)))
        batch = policy.next_batch(max_blocks=400, max_requests=64, now=float(tick))
        assert batch, "the pool always holds something that fits"
        for seq_id in batch:
            policy.remove(seq_id)
        if "long" in batch:
            return tick
    return None


@pytest.mark.parametrize("name", ["aligned", "aligned-strict"])
def test_starving_long_request_is_chosen_once_its_wait_passes_the_threshold(name: str) -> None:
    assert _starvation_run(threshold=10.0, num_ticks=50, name=name) == 11


@pytest.mark.parametrize("name", ["aligned", "aligned-strict"])
def test_without_starvation_control_the_long_request_waits_indefinitely(name: str) -> None:
    assert _starvation_run(threshold=None, num_ticks=500, name=name) is None


def test_aligned_takes_a_pool_that_fits_whole_unless_padding_makes_a_split_faster() -> None:
    for step_time, expected in ((None, {"long", "s0", "s1"}), (padded_step_time, {"s0", "s1"})):
        policy = get_policy("aligned", PolicyConfig(min_requests=1), step_time)
        policy.add(SeqView("long", LONG_LENGTH, LONG_BLOCKS, arrival_time=0.0))
        for i in range(2):
            policy.add(SeqView(f"s{i}", 100, SHORT_BLOCKS, arrival_time=1.0))
        assert set(policy.next_batch(max_blocks=400, max_requests=64, now=1.0)) == expected


def test_aligned_narrows_a_batch_that_dfs_widens_to_min_requests_where_padding_costs() -> None:
    """A pool larger than a batch, whose short requests are fewer than ``min_requests``:
    DFS borrows long ones to make up the count, and every padded step would read the short
    ones to the longest. `aligned` runs short and long apart, since two steps over the
    parts are predicted faster than one over both; under a total-work cost it serves the
    pool oldest first, as fcfs does."""
    def first_batch(name: str, step_time: StepTime | None = None) -> list[str]:
        policy = get_policy(name, PolicyConfig(min_requests=12), step_time)
        for i in range(8):
            policy.add(SeqView(f"s{i}", 100 + i, SHORT_BLOCKS, arrival_time=float(i)))
        for i in range(4):  # either class fits alone, not both
            policy.add(SeqView(f"l{i}", 1000 + i, 63, arrival_time=0.5 + i))
        return policy.next_batch(max_blocks=300, max_requests=64, now=10.0)

    assert any(seq_id.startswith("l") for seq_id in first_batch("aligned-strict")), \
        "DFS mixes lengths to reach min_requests"
    kinds = {seq_id[0] for seq_id in first_batch("aligned", padded_step_time)}
    assert kinds in ({"s"}, {"l"}), "one length class per batch"
    assert first_batch("aligned") == first_batch("fcfs")


def _mixed_pool(step_time: object) -> tuple[Policy, Policy]:
    """`aligned` (deciding with ``step_time``) and fcfs over one pool that does not fit a
    batch: long and short requests interleaved in arrival order."""
    aligned = get_policy("aligned", PolicyConfig(min_requests=1), step_time)
    fcfs = get_policy("fcfs", PolicyConfig())
    for i in range(12):
        length = 900 + i if i % 3 == 0 else 40 + i
        seq = SeqView(f"r{i}", length, -(-length // 16), arrival_time=float(i))
        aligned.add(seq)
        fcfs.add(seq)
    return aligned, fcfs


def test_aligned_serves_the_pool_oldest_first_where_a_step_costs_its_total_work() -> None:
    """Under a total-work (split-K, paged) cost no grouping by length pays, so `aligned`
    takes what fcfs takes, where under a padded cost it groups the short requests."""
    aligned, fcfs = _mixed_pool(None)
    assert not aligned.alignment_pays()
    for max_blocks, max_requests in ((130, 64), (70, 64), (400, 3)):
        batch = aligned.next_batch(max_blocks=max_blocks, max_requests=max_requests, now=20.0)
        assert batch == fcfs.next_batch(max_blocks, max_requests, now=20.0)
    padded, _ = _mixed_pool(padded_step_time)
    assert padded.alignment_pays()
    batch = padded.next_batch(max_blocks=130, max_requests=64, now=20.0)
    assert batch and all(padded.tree.get(seq_id).length < 100 for seq_id in batch)


def test_aligned_prefetches_nothing_where_a_step_costs_its_total_work() -> None:
    """Where grouping cannot pay there is nothing to match, and a dynamic prefetch would
    only bind pooled requests to one decode instance early:
    the pool waits for the next batch, as fcfs's does. Under a padded cost the window
    matches, shortest first, as aligned-strict."""
    aligned, _ = _mixed_pool(None)
    assert aligned.matching(40, 950, max_blocks=200, max_requests=4, now=20.0) == []
    assert aligned.matching(45, 60, max_blocks=200, max_requests=10, now=20.0) == []
    assert aligned.next_batch(max_blocks=200, max_requests=4, now=20.0) == [
        "r0", "r1", "r2", "r3"]
    padded, _ = _mixed_pool(padded_step_time)  # shortest first, as aligned-strict
    assert padded.matching(40, 950, max_blocks=200, max_requests=4, now=20.0) == [
        "r1", "r2", "r4", "r5"]


def test_aligned_keeps_the_window_when_the_pool_has_drained_to_one_long_request() -> None:
    """A pool of one request shows no spread by itself; with the running batch's window it
    does under a padded cost, so the long request stays out of the short batch (a padded run
    mixed its last long requests in). Under a total-work cost
    nothing is matched either, and the next batch takes it, as fcfs's would."""
    for step_time in (padded_step_time, None):
        policy = get_policy("aligned", PolicyConfig(min_requests=1), step_time)
        policy.add(SeqView("long", 900, 57, arrival_time=0.0))
        assert policy.matching(40, 60, max_blocks=200, max_requests=4, now=1.0) == []
        assert policy.next_batch(max_blocks=200, max_requests=4, now=1.0) == ["long"]


def test_matching_returns_pool_requests_in_the_window_shortest_first() -> None:
    policy = get_policy("aligned-loose", PolicyConfig())  # the window widened by match_slack
    for seq_id, length in [("x", 90), ("y", 105), ("z", 120), ("w", 200)]:
        policy.add(SeqView(seq_id, length, 7, 0.0))
    lo, hi = policy.prefetch_window([100, 110])
    assert (lo, hi) == (75, 137)
    assert policy.matching(lo, hi, max_blocks=100, max_requests=10, now=0.0) == ["x", "y", "z"]
    assert policy.matching(lo, hi, max_blocks=14, max_requests=10, now=0.0) == ["x", "y"]
    assert policy.matching(lo, hi, max_blocks=100, max_requests=1, now=0.0) == ["x"]
    assert get_policy("aligned-noprefetch", PolicyConfig()).matching(0, 10**6, 100, 10, 0.0) == []


def test_prefetch_window_keeps_the_batch_within_max_spread() -> None:
    policy = get_policy("aligned-strict", PolicyConfig())  # max_spread 1.5 by default
    assert policy.prefetch_window([100, 110]) == (74, 150)  # ceil(110 / 1.5), 100 * 1.5
    assert policy.prefetch_window([100, 140]) == (94, 150)
    assert policy.prefetch_window([100, 200]) == (0, -1)  # already wider than 1.5x: none


def test_continuous_policy_has_no_pool() -> None:
    policy = get_policy("continuous", PolicyConfig())
    assert isinstance(policy, ContinuousPolicy)
    with pytest.raises(ValueError, match="no host pool"):
        policy.add(SeqView("a", 1, 1, 0.0))
    assert policy.next_batch(100, 10, now=0.0) == [] and len(policy) == 0
