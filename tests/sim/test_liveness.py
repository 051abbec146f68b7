"""Liveness as a property: under every registered policy, random workloads (lengths from a
few tokens to the context limit, bursts and trickles, tiny and large decode, staging and
host capacities, a device per instance or one shared, starvation thresholds from 0 to off)
all finish in the simulator, no request goes back and forth between the host pool and a
device more than a few times, and the run's events stay proportional to the work done (a
livelock would spin forever). And one workload of the bench's family that once stalled."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.workloads import Workload, WorkloadRequest
from scheduler import POLICIES
from scheduler.cost_model import KERNELS
from scheduler.hardware import Hardware
from sim import ClusterConfig, CostModel, CostParams, get_geometry, simulate

CONTEXT = 512  # tokens: the context limit of the random workloads
BLOCK_SIZE = 16
MAX_POOL_MOVES = 3  # round trips device -> host pool one request may make (see below)
EVENTS_PER_UNIT = 40  # loop events allowed per output token or KV block of work


def cost_model(kernel: str) -> CostModel:
    """A small GPU-like device on which a decode step takes about a millisecond."""
    hw = Hardware("live", memory_bandwidth=5e9, matmul_rate=1e12, num_sms=8,
                  memory_bytes=1e12, host_link_bandwidth=1e9, device_link_bandwidth=4e9,
                  host_memory_bytes=1e12)
    return CostModel(get_geometry("opt-tiny"), hw, CostParams(step_overhead=1e-3),
                     kernel)  # type: ignore[arg-type]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    n = draw(st.integers(1, 40))
    burst = draw(st.booleans())
    reqs = []
    for i in range(n):
        prompt = draw(st.integers(1, CONTEXT - 1))
        output = draw(st.integers(1, min(32, CONTEXT - prompt)))
        arrival = 0.0 if burst else draw(st.floats(0.0, 0.2))
        reqs.append(WorkloadRequest(f"r{i}", prompt, output, arrival))
    return Workload("live", tuple(reqs))


def capacity(draw: st.DrawFn, need: int, total: int) -> int:
    """Blocks: from just the largest request (or a share of all requests' blocks, so that
    the store fills while others wait on it) to plenty."""
    return draw(st.sampled_from([need, need + 2, 2 * need, max(need, total // 4),
                                 max(need, total // 2), 8 * need, 64 * need]))


@st.composite
def clusters(draw: st.DrawFn, workload: Workload) -> ClusterConfig:
    blocks = [-(-(r.prompt_len + r.output_len) // BLOCK_SIZE) for r in workload.requests]
    need, total = max(blocks), sum(blocks)
    # a device of its own for each instance, or one that prefills and decodes (where a
    # policy may pace prefill to the decode steps: `Policy.prefill_quota`)
    devices = draw(st.sampled_from([{"prefill_devices": ("p0",), "decode_devices": ("d0",)},
                                    {"prefill_devices": ("d0",), "decode_devices": ("d0",)}]))
    return ClusterConfig.create(
        **devices, block_size=BLOCK_SIZE,
        num_decode_blocks=capacity(draw, need, total),
        num_prefill_blocks=capacity(draw, need, total),
        num_staging_blocks=draw(st.sampled_from([1, need, 8 * need])),
        num_host_blocks=capacity(draw, need, total), max_prefill_tokens=CONTEXT,
        max_batch_size=draw(st.sampled_from([1, 2, 8, 32])),
        min_requests=draw(st.sampled_from([1, 4])),
        starvation_threshold=draw(st.sampled_from([0.0, 0.01, 0.1, None])))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), policy=st.sampled_from(sorted(POLICIES)),
       kernel=st.sampled_from(KERNELS))
def test_every_request_finishes_under_every_policy(data: st.DataObject, policy: str,
                                                   kernel: str) -> None:
    workload = data.draw(workloads())
    config = data.draw(clusters(workload))
    work = sum(r.output_len + -(-(r.prompt_len + r.output_len) // BLOCK_SIZE)
               for r in workload.requests)
    limit = EVENTS_PER_UNIT * work + 1000
    result = simulate(workload, policy, config, cost_model(kernel), record_tokens=False,
                      max_events=limit)
    assert result.num_loop_events < limit, "the run kept going without finishing its work"
    assert result.num_finished == workload.num_requests
    assert all(n == 0 for n in result.blocks_left.values())
    # NOTE: a move back to the pool is a batch switch's return (at most MAX_RETURNS per
    # request) or an eviction that found the staging buffer full; each needs the request
    # to have been admitted again in between, so a few suffice.
    to_pool = Counter(t.seq_id for t in result.transfers
                      if t.dst == "host" and not t.src.startswith("prefill"))
    assert max(to_pool.values(), default=0) <= MAX_POOL_MOVES, to_pool.most_common(3)
    # simulated time advances with the work: the last decode ends after every token
    last = max((e.time for e in result.events), default=0.0)
    assert result.end_time >= last


def test_a_family_member_whose_prefill_hold_lifted_unseen_finishes() -> None:
    """Seed 20's member 11 of the bench's family (225 requests, padded steps under the CPU
    cost model, one device that prefills and decodes): evicted seqs coming back lifted
    `aligned`'s prefill hold (`Policy.prefill_quota`) with no request starting, the
    prefill slept, and the batcher waited for its prompts; 69 requests were never served
    (the wiring looks at the hold whenever the running seqs change)."""
    from bench.family import sample_family
    from benchmarks.test_bench_family import BLOCK_SIZE as FAMILY_BLOCK
    from benchmarks.test_bench_family import MAX_LEN, cpu_cost, sizes

    member = sample_family(24, 20, max_len=MAX_LEN)[11]
    blocks = sum(-(-(r.prompt_len + r.output_len) // FAMILY_BLOCK)
                 for r in member.workload.requests)
    cluster = ClusterConfig.create(**sizes(member), num_host_blocks=2 * blocks)
    result = simulate(member.workload, "aligned", cluster, cpu_cost("padded"),
                      record_tokens=False)
    assert result.num_finished == result.num_requests == 225
    assert all(n == 0 for n in result.blocks_left.values())


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize(("prompt", "output", "decode_blocks"),
                         [(1, 1, 1), (31, 1, 2), (300, 20, 20)])
def test_a_prompt_no_batch_holds_is_prefilled_on_a_shared_device(
        policy: str, prompt: int, output: int, decode_blocks: int) -> None:
    """One request that fits decode KV but not a batch's share of it (``batch_kv_fraction``
    0.9, rounded down: 0 of 1 block, 1 of 2, 18 of 20), on a device that prefills and
    decodes: `aligned`'s prefill hold waited for the pool's next batch, which no cut of a
    too-big prompt gives, and the request was never prefilled."""
    workload = Workload("big", (WorkloadRequest("r0", prompt, output, 0.0),))
    config = ClusterConfig.create(
        prefill_devices=("d0",), decode_devices=("d0",), block_size=BLOCK_SIZE,
        num_decode_blocks=decode_blocks, num_prefill_blocks=decode_blocks,
        num_staging_blocks=1, num_host_blocks=decode_blocks, max_prefill_tokens=CONTEXT,
        max_batch_size=1, min_requests=1)
    result = simulate(workload, policy, config, cost_model("per-seq"), record_tokens=False,
                      max_events=1000)
    assert result.num_finished == 1
    assert all(n == 0 for n in result.blocks_left.values())


# 14 prompts and outputs of up to 64 tokens: decode and prefill hold 11 blocks (the largest
# request's 11), the staging buffer 1, the host pool 28 (29 % of all requests' blocks)
FULL_STORES = ((116, 58), (96, 35), (16, 29), (110, 64), (68, 10), (111, 49), (68, 16),
               (50, 64), (68, 41), (3, 44), (116, 9), (17, 35), (26, 55), (37, 58))


def full_stores(**sizes: int) -> tuple[Workload, ClusterConfig]:
    """`FULL_STORES` at once, on a prefill and a decode device of their own, the decode
    device, staging buffer and host pool of ``sizes`` blocks."""
    workload = Workload("full", tuple(WorkloadRequest(f"r{i}", p, o, 0.0)
                                      for i, (p, o) in enumerate(FULL_STORES)))
    return workload, ClusterConfig.create(
        prefill_devices=("p0",), decode_devices=("d0",), block_size=BLOCK_SIZE,
        num_prefill_blocks=11, max_prefill_tokens=CONTEXT, max_batch_size=32,
        min_requests=1, starvation_threshold=None, **sizes)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_seq_dropped_for_want_of_room_does_not_idle_the_instance(policy: str) -> None:
    """With the staging buffer and the host pool full, a step whose running seqs cannot
    grow drops the longest seq's KV (it is prefilled again); no copy lands after that to
    bring the next boundary, and `aligned-strict` (whose switch had sent a seq back to
    the full pool, so it stayed) left the decode instance idle with its room freed, and 4
    of the 14 requests finished. The step goes on with the room the dropped seq freed."""
    workload, config = full_stores(num_decode_blocks=11, num_staging_blocks=1,
                                   num_host_blocks=28)
    result = simulate(workload, policy, config, cost_model("padded"), record_tokens=False,
                      max_events=20_000)
    assert result.num_finished == workload.num_requests
    assert all(n == 0 for n in result.blocks_left.values())


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_an_abort_while_a_boundary_copies_ends_that_request_alone(
        policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A boundary plans its admissions, then copies seqs out of the running batch (a
    switch's returns to the pool, evictions); an abort that lands meanwhile ends a staged
    candidate the plan admits. The admissions then skip it: before, the instance failed on
    the missing seq (KeyError), and with it every request it held. The abort is made to
    land at the first such boundary of the run; `aligned-strict` makes one here."""
    from aserve.cores.decode import DecodeCore

    aborted: list[str] = []
    boundary = DecodeCore.boundary

    def racing_boundary(self: DecodeCore, now: float) -> list:  # type: ignore[type-arg]
        moves = boundary(self, now)
        plan = self._admissions
        if moves and plan is not None and not aborted:
            for seq_id in (*plan.admit_batch, *plan.admit_requests)[:1]:
                aborted.append(seq_id)
                self.life.abort(seq_id)
                self.reap(now)
        return moves

    monkeypatch.setattr(DecodeCore, "boundary", racing_boundary)
    workload, config = full_stores(num_decode_blocks=22, num_staging_blocks=11,
                                   num_host_blocks=97)
    result = simulate(workload, policy, config, cost_model("padded"), max_events=20_000)
    assert bool(aborted) or policy != "aligned-strict", "the race did not happen"
    assert result.num_finished == workload.num_requests
    assert all(n == 0 for n in result.blocks_left.values())
    tokens = Counter(e.seq_id for e in result.events if e.kind == "token")
    outputs = {f"r{i}": o for i, (_, o) in enumerate(FULL_STORES)}
    for seq_id in aborted:
        assert 1 + tokens[seq_id] < outputs[seq_id]  # it ended early, the others did not
    assert all(1 + tokens[r.request_id] == r.output_len
               for r in workload.requests if r.request_id not in aborted)


def test_a_return_the_full_host_pool_cannot_take_does_not_livelock() -> None:
    """A case the liveness hunt found (tests/data/liveness_full_pool_aborts.json): the host
    pool full, `aligned-strict`'s batch switch returns running seqs to it and admits the
    candidate batch in the room they leave. The pool could not take them, so they stayed;
    the admissions filled the room the running seqs grow into, the step evicted one, and
    the next boundary planned the same, with no token between (30 of 120 requests ended
    within the event cap). Such a seq leaves as an evicted one would."""
    case = json.loads((Path(__file__).parent.parent / "data"
                       / "liveness_full_pool_aborts.json").read_text())
    workload = Workload("full-pool", tuple(WorkloadRequest(f"r{i}", p, o, 0.0)
                                           for i, (p, o) in enumerate(case["requests"])))
    config = ClusterConfig.create(prefill_devices=("p0",), decode_devices=("d0",),
                                  block_size=BLOCK_SIZE, starvation_threshold=None,
                                  **case["cluster"])
    result = simulate(workload, "aligned-strict", config, cost_model("padded"),
                      record_tokens=False, aborts=case["aborts"], max_events=100_000)
    assert result.num_finished == workload.num_requests
    assert all(n == 0 for n in result.blocks_left.values())
