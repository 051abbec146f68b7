"""The block ledger both drivers share: a move reserves its destination, and the source is
freed only when the copy lands (or the destination when it fails)."""

from __future__ import annotations

from aserve.cores import BlockLedger
from aserve.engine.sequence import Request, SamplingParams, SeqState


def ledger(**sizes: int) -> BlockLedger:
    """Stores on devices of their own: every move is a copy."""
    return BlockLedger({n: (n, k) for n, k in sizes.items()}, block_size=4, share_memory=False)


def seq(num_tokens: int, request_id: str = "a") -> SeqState:
    request = Request(request_id=request_id, prompt_token_ids=(1,) * num_tokens,
                      sampling=SamplingParams(), arrival_time=0.0)
    s = SeqState.from_request(request)
    s.num_computed_tokens = num_tokens
    return s


def test_a_move_holds_both_stores_until_it_lands() -> None:
    kv = ledger(host=10, decode0=3)
    s = seq(9)
    assert kv.allocate(s, "host", 9) and kv.free_blocks("host") == 7
    move = kv.reserve(s, "decode0")
    assert move is not None and move.num_blocks == 3
    assert (kv.free_blocks("host"), kv.free_blocks("decode0"), s.location) == (7, 0, "host")
    src, dst = kv.tables(move)
    assert len(src) == len(dst) == 3
    kv.commit(move, 1.0, 2.0)
    assert (kv.free_blocks("host"), kv.free_blocks("decode0"), s.location) == (10, 0, "decode0")
    assert not kv.grow(s, 13) and kv.grow(s, 12)  # a 4th block does not fit; 12 tokens do
    assert [(t.src, t.dst, t.num_blocks) for t in kv.transfers] == [("host", "decode0", 3)]
    kv.release(s)
    assert kv.blocks_used() == {"prefill": 0, "staging": 0, "host": 0, "decode": 0}
    kv.check_integrity()


def test_a_full_destination_or_a_failed_copy_changes_nothing() -> None:
    kv = ledger(host=10, decode0=1)
    s = seq(8)
    kv.allocate(s, "host", 8)
    assert kv.reserve(s, "decode0") is None
    kv2 = ledger(host=10, decode0=4)
    kv2.allocate(s2 := seq(8), "host", 8)
    move = kv2.reserve(s2, "decode0")
    assert move is not None
    kv2.cancel(move)
    assert (kv2.free_blocks("host"), kv2.free_blocks("decode0"), s2.location) == (8, 4, "host")


def test_a_fork_copies_the_parents_blocks_as_they_were_reserved() -> None:
    kv = ledger(prefill0=6)
    parent, child, other = seq(9), seq(9, "b"), seq(9, "c")
    kv.allocate(parent, "prefill0", 9)
    parent_ids = kv.table(parent)
    child.num_computed_tokens = other.num_computed_tokens = 8  # the prompt but its last
    move = kv.reserve(child, "prefill0", parent)
    assert move is not None and (move.src, move.dst, move.num_blocks) == ("prefill0",) * 2 + (2,)
    assert not child.location and kv.free_blocks("prefill0") == 1  # it lives there once copied
    assert kv.reserve(other, "prefill0", parent) is None  # full: nothing changed
    assert not other.location and kv.free_blocks("prefill0") == 1
    kv.release(parent)  # the parent may finish before the copy; its ids were taken
    src, dst = kv.tables(move)
    assert src == parent_ids[:2] and dst == kv.allocators["prefill0"].table("b")
    kv.commit(move, 1.0, 1.0)
    assert kv.free_blocks("prefill0") == 4 and child.location == "prefill0"
    failed = kv.reserve(other, "prefill0", child)
    assert failed is not None
    kv.cancel(failed)  # a failed fork holds nothing, and frees nothing of its source
    assert not other.location and kv.free_blocks("prefill0") == 4
    kv.release(child)
    kv.check_integrity()


def test_transfer_records_are_bounded_and_every_move_is_counted() -> None:
    kv = BlockLedger({"host": ("host", 4), "decode0": ("decode0", 4)}, block_size=4,
                     share_memory=False, trace_limit=4)
    s = seq(4)
    kv.allocate(s, "host", 4)
    for i in range(11):  # back and forth: each move lands and frees its source
        move = kv.reserve(s, "decode0" if s.location == "host" else "host")
        assert move is not None
        kv.commit(move, float(i), float(i))
    assert kv.num_transfers == 11
    assert len(kv.transfers) <= 4
    assert [t.start_time for t in kv.transfers] == [7.0, 8.0, 9.0, 10.0][-len(kv.transfers):]
    kv.release(s)
    kv.check_integrity()
