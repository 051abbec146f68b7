"""`aligned` forms no new batch while requests on their way to the pool on a device that
also decodes (`Policy.incoming`) could join it, where a spread of lengths costs; such a
device prefills shortest first, a prompt overtaken by later arrivals for `PREFILL_PASSES`
prefills first, and prefills a prompt only when it would start decoding soon
(`Policy.prefill_quota`); and the simulated cluster does all three only where prefill and
decode share a device."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from bench.workloads import Workload, WorkloadRequest, synthetic
from scheduler import PolicyConfig, SeqView, get_policy
from scheduler.aligned import CUT_SPAN, AlignedPolicy
from scheduler.policy import PREFILL_LEAD, PREFILL_PASSES
from sim import ClusterConfig, SimResult, simulate
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
    policy.incoming = [1000] * 5  # the whole pool fits one batch: any could join it
    assert policy.next_batch(10_000, 64, 0.0) == []
    policy.incoming = []
    assert policy.next_batch(10_000, 64, 0.0)


def test_it_does_not_wait_for_longer_requests_once_its_batch_is_cut() -> None:
    policy = pooled()  # blocks 3, 4 and 57: the cut's first batch is s0 and s1
    policy.incoming = [45, 1000]  # 45 is shorter than the batch's longest
    assert policy.next_batch(10, 64, 0.0) == []
    policy.incoming = [60, 1000]
    assert sorted(policy.next_batch(10, 64, 0.0)) == ["s0", "s1"]


def test_a_pool_with_no_request_that_fits_gives_no_batch_while_more_is_coming() -> None:
    """Room for 2 blocks (the staging buffer nearly full, say), pooled requests of 3 and 4:
    the cut has no batch, and none is formed (the shorter request on its way was compared
    with the empty batch's longest, and the batcher failed)."""
    policy = get_policy("aligned", PolicyConfig(starvation_threshold=None), padded)
    for i, length in enumerate((40, 50)):
        policy.add(SeqView(f"s{i}", length, -(-length // 16), 0.0))
    policy.incoming = [45]
    assert policy.next_batch(2, 64, 0.0) == []
    policy.incoming = []
    assert policy.next_batch(2, 64, 0.0) == []
    assert sorted(policy.next_batch(7, 64, 0.0)) == ["s0", "s1"]


def test_it_does_not_wait_where_a_step_costs_its_total_work() -> None:
    policy = pooled(lambda lengths: 1e-6 * (4096 + sum(lengths)))  # paged, split-K
    policy.incoming = [10] * 5
    assert sorted(policy.next_batch(10_000, 64, 0.0)) == ["s0", "s1", "s2"]


def test_it_waits_past_a_batch_until_the_pool_holds_what_the_cut_looks_at() -> None:
    policy = pooled()  # 64 blocks in all
    policy.incoming = [10] * 5
    assert policy.next_batch(10, 64, 0.0) == []  # more than a batch, less than the span
    assert policy.next_batch(64 // CUT_SPAN - 1, 64, 0.0)  # more than the span: it cuts


def backlog(devices: dict[str, tuple[str, ...]], max_batch_size: int = 32
            ) -> tuple[list[int], list[int], bool]:
    """The backlog's prompt lengths in arrival order and in the order they were prefilled,
    and whether the first decode step started before the last prefill."""
    load = synthetic(24, short_ratio=0.75, short_range=(16, 48), long_range=(200, 300),
                     output_range=(8, 16), seed=2)
    cluster = ClusterConfig.create(num_decode_blocks=400, num_prefill_blocks=128,
                                   num_staging_blocks=400, num_host_blocks=2000,
                                   max_prefill_tokens=256, min_requests=4,
                                   max_batch_size=max_batch_size, **devices)
    result = simulate(load, "aligned", cluster, cost_model("padded"))
    assert result.num_finished == 24
    prefills = result.prefill_iterations
    decodes = [it.start_time for it in result.iterations if it.instance.startswith("decode")]
    return ([r.prompt_len for r in load.requests], [n for it in prefills for n in it.lengths],
            min(decodes) < prefills[-1].start_time)


def test_a_shared_device_prefills_a_backlog_shortest_first_and_decodes_meanwhile() -> None:
    arrival, prefilled, overlap = backlog({})  # one "cpu" for both
    assert prefilled == sorted(arrival) and prefilled != arrival
    assert not overlap  # the pool's cut takes the whole backlog as one batch
    _, _, overlap = backlog({}, max_batch_size=8)
    assert overlap  # the 8 shortest decode while the longer prompts are prefilled
    arrival, prefilled, _ = backlog({"prefill_devices": ("p0",), "decode_devices": ("d0",)})
    assert prefilled == arrival  # apart: arrival order, as every other policy


def test_a_backlog_submitted_at_once_is_prefilled_shortest_first_to_its_end() -> None:
    """Submitted together, a backlog's requests carry distinct arrival stamps in the order
    they were submitted, yet none arrived after a prefill passed another over: none is
    overtaken, and every prefill takes the shortest prompts left, however many prefills
    the backlog takes (counted by arrival stamps alone, it went on in arrival order after
    `PREFILL_PASSES` prefills)."""
    load = synthetic(60, short_ratio=0.5, short_range=(16, 200), long_range=(200, 400),
                     output_range=(8, 16), seed=4)
    cluster = ClusterConfig.create(num_decode_blocks=2000, num_prefill_blocks=128,
                                   num_staging_blocks=2000, num_host_blocks=4000,
                                   max_prefill_tokens=128, min_requests=4, max_batch_size=64)
    result = simulate(load, "aligned", cluster, cost_model("padded"))
    assert result.num_finished == 60
    assert len(result.prefill_iterations) > 4 * PREFILL_PASSES
    prefilled = [n for it in result.prefill_iterations for n in it.lengths]
    assert prefilled == sorted(r.prompt_len for r in load.requests)


def test_a_prompt_overtaken_by_later_arrivals_waits_a_bounded_number_of_prefills() -> None:
    """A long prompt behind a stream of shorter ones: shortest first would leave it for
    last; it goes once arrivals later than the first prefill that passed it over have
    overtaken it in `PREFILL_PASSES` prefills."""
    reqs = [WorkloadRequest("long", 300, 4, 0.0), WorkloadRequest("first", 20, 4, 0.0),
            *(WorkloadRequest(f"s{i}", 20, 4, 1e-4 * (i + 1)) for i in range(40))]
    cluster = ClusterConfig.create(num_decode_blocks=400, num_prefill_blocks=128,
                                   num_staging_blocks=400, num_host_blocks=2000,
                                   max_prefill_tokens=64, min_requests=4, max_batch_size=32)
    result = simulate(Workload("overtaken", tuple(reqs)), "aligned", cluster,
                      cost_model("padded"))
    assert result.num_finished == len(reqs)
    first = next(e.time for e in result.events
                 if e.kind == "first_token" and e.seq_id == "long")
    before = [it.lengths for it in result.prefill_iterations if it.start_time < first]
    # "first" (in line with "long" then) passes it over; the stream overtakes it
    assert before[:-1] == [(20,), *([(20, 20, 20)] * PREFILL_PASSES)]
    assert before[-1] == (300,)
    assert len(result.prefill_iterations) > len(before) + 3  # the stream went on after it


def test_requests_that_end_before_the_pool_do_not_leave_aligned_waiting() -> None:
    """The last requests on their way to the pool end there (one output token, or an
    abort while they wait for prefill): the batcher is woken, and the pooled ones decode."""
    import dataclasses

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


def unstarted_at_prefills(result: SimResult) -> list[int]:
    """At each prefill's start, the requests with a first token and no second (not ended)."""
    events = sorted(result.events, key=lambda e: e.time)
    counts = []
    for it in result.prefill_iterations:
        seen: dict[str, bool] = {}
        for e in events:
            if e.time > it.start_time:
                break
            if e.kind == "first_token":
                seen[e.seq_id] = True
            elif e.kind in ("token", "finish"):
                seen.pop(e.seq_id, None)
        counts.append(len(seen))
    return counts


def held_and_not(load: Workload, cluster: ClusterConfig) -> tuple[SimResult, SimResult]:
    """``load`` under `aligned` (padded steps), with its prefill quota and with every
    waiting prompt let through (`Policy.prefill_quota` never holding)."""
    held = simulate(load, "aligned", cluster, cost_model("padded"))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(AlignedPolicy, "prefill_quota",
                  lambda self, unstarted, running, waiting: len(waiting))
        unheld = simulate(load, "aligned", cluster, cost_model("padded"))
    assert held.num_finished == unheld.num_finished == load.num_requests
    return held, unheld


def test_a_backlog_is_prefilled_paced_to_its_decode_steps() -> None:
    """A backlog on a device that prefills and decodes (padded steps): no prefill starts
    while as many prefilled requests wait for their second token as run, and at least
    `PREFILL_LEAD`; so those requests no longer wait through the backlog between their first
    and second tokens, and P99 TPOT falls. Without pacing, the whole backlog waits so."""
    load = synthetic(120, short_ratio=0.8, short_range=(16, 64), long_range=(300, 600),
                     output_range=(8, 24), seed=3)
    cluster = ClusterConfig.create(num_decode_blocks=400, num_prefill_blocks=128,
                                   num_staging_blocks=400, num_host_blocks=4000,
                                   max_prefill_tokens=256, min_requests=4, max_batch_size=24)
    paced, unpaced = held_and_not(load, cluster)
    widest = max(len(it.lengths) for it in paced.iterations)
    assert max(unstarted_at_prefills(paced)) < max(PREFILL_LEAD, widest)
    assert max(unstarted_at_prefills(unpaced)) > max(PREFILL_LEAD, widest) + 16
    assert paced.summary().tpot_p99 < 0.8 * unpaced.summary().tpot_p99


def waits_for_second_token(result: SimResult) -> list[float]:
    """Each request's wait between its first token and its second (those with two)."""
    first: dict[str, float] = {}
    second: dict[str, float] = {}
    for e in sorted(result.events, key=lambda e: e.time):
        if e.kind == "first_token":
            first[e.seq_id] = e.time
        elif e.kind == "token":
            second.setdefault(e.seq_id, e.time)
    return sorted(second[i] - first[i] for i in second)


def short_and_long(rate: float | None = None) -> tuple[Workload, ClusterConfig]:
    """60 prompts, 80 % of 16-64 tokens and the rest of 300-600, outputs of 32-128
    tokens (arriving at once, or as a Poisson stream at ``rate``), on one device."""
    load = synthetic(60, short_ratio=0.8, short_range=(16, 64), long_range=(300, 600),
                     output_range=(32, 128), rate=rate, seed=3)
    return load, ClusterConfig.create(num_decode_blocks=2000, num_prefill_blocks=128,
                                      num_staging_blocks=2000, num_host_blocks=4000,
                                      max_prefill_tokens=1024, min_requests=4,
                                      max_batch_size=64)


def test_a_prompt_no_running_batch_takes_is_prefilled_when_its_batch_comes() -> None:
    """A backlog of short prompts and a few long ones with outputs of 32-128 tokens on a
    device that prefills and decodes (padded steps): the long prompts join no batch of
    short ones, and prefilled at once, they wait for their second token until the short
    batch drains. Prefilled as their batch comes, no request waits so, P99 TPOT halves,
    and decode throughput holds."""
    held, unheld = held_and_not(*short_and_long())
    assert max(waits_for_second_token(held)) < 0.25 * max(waits_for_second_token(unheld))
    assert held.summary().tpot_p99 < 0.6 * unheld.summary().tpot_p99
    assert held.summary().decode_throughput > 0.97 * unheld.summary().decode_throughput


def quota_policy(step_time=padded):  # type: ignore[no-untyped-def]
    """`aligned` with a batch room of 64 blocks and 8 requests and two short pooled
    requests (blocks of 16 tokens)."""
    policy = get_policy("aligned", PolicyConfig(starvation_threshold=None), step_time)
    policy.batch_room = (64, 8)
    for i, length in enumerate((40, 44)):
        policy.add(SeqView(f"s{i}", length, -(-length // 16), 0.0))
    return policy


def prompts(*lengths: int, arrival: float = 0.0) -> list[tuple[int, int, float]]:
    return [(n, -(-n // 16), arrival) for n in lengths]


def test_the_quota_prefills_what_joins_the_running_batch_and_holds_the_rest() -> None:
    policy = quota_policy()
    running = [50] * 20
    # no longer than the running seqs: refills; the long one after them waits
    assert policy.prefill_quota(0, running, prompts(45, 48, 900)) == 2
    assert policy.prefill_quota(0, running, prompts(900, 950)) == 0
    # refills wait too once as many prefilled requests wait as run
    assert policy.prefill_quota(len(running), running, prompts(45, 48)) == 0


def test_the_quota_prefills_the_next_batch_once_the_running_batch_is_at_its_floor() -> None:
    policy = quota_policy()  # pool: 40 and 44; a batch: 8 requests, 64 blocks
    # nothing runs: the prompts the pool's next batch takes (its cut leaves 900 apart)
    assert policy.prefill_quota(2, [], prompts(46, 50, 900)) == 2
    # two seqs left of twenty-two: at the floor, the same
    assert policy.prefill_quota(2, [60, 61], prompts(46, 50, 900)) == 2
    # the whole next batch is pooled (950 does not fit beside it): nothing until it starts
    assert policy.prefill_quota(2, [], prompts(950, 1000)) == 0


def test_the_quota_prefills_the_next_batch_where_it_would_join_the_running_one() -> None:
    """Where a step's fixed part outweighs its padding, a batch of long seqs joins a
    running batch of short ones (`mixing_pays`): its prompts are prefilled at once."""
    def fixed(lengths: Sequence[int]) -> float:  # padded, with a large fixed part
        return 1e-6 * (10**7 + len(lengths) * max(lengths, default=0))
    policy = quota_policy(fixed)
    for n in range(2, 8):
        policy.add(SeqView(f"s{n}", 900, 57, 0.0))
    assert policy.prefill_quota(0, [50] * 20, prompts(900, 950)) > 0


def test_the_quota_lets_an_overtaken_prompt_wait_for_the_lead_only() -> None:
    policy = quota_policy()
    running = [50] * 20
    # a long prompt first in line, before the shortest: overtaken by later arrivals
    assert policy.prefill_quota(0, running, prompts(900, 45, 48)) == 1
    assert policy.prefill_quota(max(PREFILL_LEAD, 20), running, prompts(900, 45)) == 0


def test_under_a_stream_prompts_are_prefilled_as_they_come() -> None:
    """The same prompts arriving as a Poisson stream: a prompt that arrived after the
    running batch started is no backlog that batch passed over, and holding it would move
    its wait onto its first token (P99 TTFT many times fcfs's). Its first token comes as
    it would with no hold."""
    held, unheld = held_and_not(*short_and_long(rate=40.0))
    assert held.summary().ttft_p99 <= 1.05 * unheld.summary().ttft_p99
