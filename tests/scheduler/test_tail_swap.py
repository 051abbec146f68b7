"""The cost-aware `aligned` in a backlog's tail where grouping cannot pay (split-K, paged):
an evicted seq that has waited ``SWAP_STEPS`` boundaries takes the room of running seqs
that have made as many tokens since they joined, so that no seq sits out the tail to
finish alone (scheduler/aligned.py, ``_swap``). Pure policy, virtual time."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler import BoundaryView, PolicyConfig, SeqView, aligned, get_policy
from scheduler.batching import ADMIT_LOOKAHEAD, blocks_to_admit, growth

BLOCK_SIZE = 16
MAX_BATCH = 8


def split_k_step_time(lengths: Sequence[int]) -> float:
    """A split-K step: weights worth 4096 KV tokens plus the tokens read (no padding)."""
    return 1e-6 * (4096 + sum(lengths))


def running_seq(seq_id: str, arrival: float, tokens: int, length: int = 160) -> SeqView:
    return SeqView(seq_id, length, length // BLOCK_SIZE, arrival, 1, num_output_tokens=tokens)


def full_view(running: Sequence[SeqView], evicted: SeqView, **kwargs: object) -> BoundaryView:
    """``running`` with room for their growth and no more; ``evicted`` waits."""
    free = growth(running, BLOCK_SIZE, ADMIT_LOOKAHEAD)
    return BoundaryView(tuple(running), free, BLOCK_SIZE, MAX_BATCH, (evicted,),
                        kwargs.pop("batch", ()), 1, now=1.0)  # type: ignore[arg-type]


def policy() -> aligned.AlignedPolicy:
    p = get_policy("aligned", PolicyConfig(starvation_threshold=None), split_k_step_time)
    assert isinstance(p, aligned.AlignedPolicy) and not p.alignment_pays([16, 4000])
    return p


def test_a_stalled_seq_swaps_with_the_latest_arrival_after_the_bound() -> None:
    running = [running_seq(f"r{i}", float(i), tokens=50) for i in range(4)]
    evicted = SeqView("e", 160, 10, 0.5, 1, waiting_since=0.5, num_output_tokens=30)
    p = policy()
    plans = [p.plan_boundary(full_view(running, evicted)) for _ in range(aligned.SWAP_STEPS)]
    assert all(plan == type(plan)() for plan in plans[:-1])  # it waits out the bound
    assert plans[-1].evict == ("r3",) and plans[-1].admit_requests == ("e",)
    # the room the victim leaves holds the seq, the kept seqs' growth reserved
    view = full_view(running, evicted)
    free = view.free_blocks + running[3].num_blocks
    kept_growth = growth(running[:3], BLOCK_SIZE, ADMIT_LOOKAHEAD)
    assert blocks_to_admit(evicted, BLOCK_SIZE, ADMIT_LOOKAHEAD) <= free - kept_growth


def test_as_many_victims_as_the_seq_needs_and_only_those() -> None:
    running = [running_seq(f"r{i}", float(i), tokens=50) for i in range(4)]
    long = SeqView("e", 300, 19, 0.5, 1, waiting_since=0.5, num_output_tokens=30)
    p = policy()
    for _ in range(aligned.SWAP_STEPS):
        plan = p.plan_boundary(full_view(running, long))
    assert plan.evict == ("r3", "r2") and plan.admit_requests == ("e",)  # 10 + 10 >= 20


def test_no_swap_while_requests_are_pooled_or_a_batch_is_staged() -> None:
    running = [running_seq(f"r{i}", float(i), tokens=50) for i in range(4)]
    evicted = SeqView("e", 160, 10, 0.5, 1, waiting_since=0.5, num_output_tokens=30)
    pooled = policy()
    pooled.add(SeqView("pooled", 100, 7, 2.0))
    staged = policy()
    batch = (SeqView("b", 4000, 250, 2.0, 2),)  # too large to join
    for _ in range(3 * aligned.SWAP_STEPS):
        assert not pooled.plan_boundary(full_view(running, evicted)).evict
        assert not staged.plan_boundary(full_view(running, evicted, batch=batch)).evict


def test_a_seq_is_swapped_out_only_after_swap_steps_tokens_since_it_joined() -> None:
    # r3 joined at 45 tokens and has made 5 since: the swap passes it for r2
    p = policy()
    joining = SeqView("r3", 150, 9, 3.0, -1, waiting_since=0.5, num_output_tokens=45)
    older = [running_seq(f"r{i}", float(i), tokens=50) for i in range(3)]
    view = BoundaryView(tuple(older), growth(older, BLOCK_SIZE, ADMIT_LOOKAHEAD) + 10,
                        BLOCK_SIZE, MAX_BATCH, (joining,), (), 1, now=1.0)
    assert p.plan_boundary(view).admit_requests == ("r3",)
    running = [*older, running_seq("r3", 3.0, tokens=50)]
    evicted = SeqView("e", 160, 10, 0.5, 1, waiting_since=0.5, num_output_tokens=30)
    for _ in range(aligned.SWAP_STEPS):
        plan = p.plan_boundary(full_view(running, evicted))
    assert plan.evict == ("r2",) and plan.admit_requests == ("e",)


def test_no_swap_when_the_ripe_seqs_cannot_make_its_room() -> None:
    running = [running_seq(f"r{i}", float(i), tokens=50) for i in range(2)]
    huge = SeqView("e", 4000, 250, 0.5, 1, waiting_since=0.5, num_output_tokens=30)
    p = policy()
    plans = [p.plan_boundary(full_view(running, huge)) for _ in range(3 * aligned.SWAP_STEPS)]
    assert not any(plan.evict or plan.admit_requests for plan in plans)
