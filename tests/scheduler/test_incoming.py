"""`aligned` forms no new batch while requests are on their way to the pool on a device
that also decodes (`Policy.incoming`), where a spread of lengths costs; and the simulated
cluster tells it so only where prefill and decode share a device."""

from __future__ import annotations

from collections.abc import Sequence

from bench.workloads import synthetic
from scheduler import PolicyConfig, SeqView, get_policy
from scheduler.aligned import CUT_SPAN
from sim import ClusterConfig, simulate
from tests.cores.test_differential import cost_model


def padded(lengths: Sequence[int]) -> float:
    return 1e-6 * (4096 + len(lengths) * max(lengths, default=0))


def pooled(step_time=padded):  # type: ignore[no-untyped-def]
    policy = get_policy("aligned", PolicyConfig(starvation_threshold=None), step_time)
    for i, length in enumerate((40, 50, 900)):
        policy.add(SeqView(f"s{i}", length, -(-length // 16), 0.0))
    return policy


def test_it_waits_for_the_pool_while_more_is_coming_and_a_spread_costs() -> None:
    policy = pooled()
    policy.incoming = 5
    assert policy.next_batch(10_000, 64, 0.0) == []
    policy.incoming = 0
    assert policy.next_batch(10_000, 64, 0.0)


def test_it_does_not_wait_where_a_step_costs_its_total_work() -> None:
    policy = pooled(lambda lengths: 1e-6 * (4096 + sum(lengths)))  # paged, split-K
    policy.incoming = 5
    assert sorted(policy.next_batch(10_000, 64, 0.0)) == ["s0", "s1", "s2"]


def test_it_waits_past_a_batch_until_the_pool_holds_what_the_cut_looks_at() -> None:
    policy = pooled()  # 64 blocks in all
    policy.incoming = 5
    assert policy.next_batch(10, 64, 0.0) == []  # more than a batch, less than the span
    assert policy.next_batch(64 // CUT_SPAN - 1, 64, 0.0)  # more than the span: it cuts


def first_decode_after_last_prefill(devices: dict[str, tuple[str, ...]]) -> bool:
    load = synthetic(24, short_ratio=0.75, short_range=(16, 48), long_range=(200, 300),
                     output_range=(8, 16), seed=2)
    cluster = ClusterConfig.create(num_decode_blocks=400, num_prefill_blocks=128,
                                   num_staging_blocks=400, num_host_blocks=2000,
                                   max_prefill_tokens=256, min_requests=4,
                                   max_batch_size=32, **devices)
    result = simulate(load, "aligned", cluster, cost_model("padded"))
    assert result.num_finished == 24
    prefills = [e.time for e in result.events if e.kind == "first_token"]
    decodes = [it.start_time for it in result.iterations if it.instance.startswith("decode")]
    return min(decodes) >= max(prefills)


def test_a_shared_device_prefills_the_backlog_before_aligned_decodes() -> None:
    assert first_decode_after_last_prefill({})  # one "cpu" for both
    assert not first_decode_after_last_prefill(
        {"prefill_devices": ("p0",), "decode_devices": ("d0",)})  # apart: no waiting


def test_requests_that_end_before_the_pool_do_not_leave_aligned_waiting() -> None:
    """The last requests on their way to the pool end there (one output token, or an
    abort while they wait for prefill): the batcher is woken, and the pooled ones decode."""
    import dataclasses

    from bench.workloads import Workload

    load = synthetic(24, short_ratio=0.75, short_range=(16, 48), long_range=(200, 300),
                     output_range=(8, 16), seed=2)
    reqs = [*load.requests[:18], *(dataclasses.replace(r, output_len=1)
                                   for r in load.requests[18:])]
    cluster = ClusterConfig.create(num_decode_blocks=400, num_prefill_blocks=128,
                                   num_staging_blocks=400, num_host_blocks=2000,
                                   max_prefill_tokens=64, min_requests=4, max_batch_size=32)
    short_last = simulate(Workload("one-token-last", tuple(reqs)), "aligned", cluster,
                          cost_model("padded"), max_events=100_000)
    assert short_last.num_finished == 24
    first = sorted(e.time for e in simulate(load, "aligned", cluster, cost_model(
        "padded")).events if e.kind == "first_token")
    aborts = {r.request_id: (first[17] + first[18]) / 2 for r in load.requests[18:]}
    aborted = simulate(load, "aligned", cluster, cost_model("padded"), aborts=aborts,
                       max_events=100_000)
    assert aborted.num_finished == 24
    assert sum(e.kind == "token" for e in aborted.events) > 0


def test_a_host_pool_smaller_than_the_backlog_does_not_leave_aligned_waiting() -> None:
    """Prefill stops when the pool is full; the batcher then stops waiting for the rest."""
    load = synthetic(24, short_ratio=0.75, short_range=(16, 48), long_range=(200, 300),
                     output_range=(8, 16), seed=2)
    cluster = ClusterConfig.create(num_decode_blocks=400, num_prefill_blocks=128,
                                   num_staging_blocks=400, num_host_blocks=60,
                                   max_prefill_tokens=64, min_requests=4, max_batch_size=32)
    result = simulate(load, "aligned", cluster, cost_model("padded"), max_events=100_000)
    assert result.num_finished == 24
