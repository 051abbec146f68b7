"""BlockAllocator: tables, running out, double frees, and integrity under any sequence of calls;
stores sharing one pool (one KV tensor): quotas and hand-overs."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from transport.blocks import PAD_BLOCK_ID, BlockAllocator, BlockPool

NUM_BLOCKS = 16
BLOCK_SIZE = 4  # tokens


def test_allocate_covers_the_tokens_with_lowest_free_ids() -> None:
    allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    assert allocator.allocate("a", 5) == [1, 2]
    assert allocator.allocate("b", 4) == [3]
    assert allocator.free("a") == 2
    assert allocator.allocate("c", 12) == [1, 2, 4]
    assert PAD_BLOCK_ID not in allocator.table("c")
    allocator.check_integrity()


def test_the_high_water_mark_is_the_highest_id_ever_handed_out() -> None:
    # the blocks of a lazily allocated KV tensor that were ever written: its resident part
    allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    assert allocator.pool.high_water == PAD_BLOCK_ID
    allocator.allocate("a", 3 * BLOCK_SIZE)
    allocator.allocate("b", BLOCK_SIZE)
    assert allocator.pool.high_water == 4
    allocator.free("a"), allocator.free("b")
    assert allocator.pool.high_water == 4  # freeing does not give pages back
    allocator.allocate("c", 2 * BLOCK_SIZE)  # the lowest ids again: no new page
    assert allocator.pool.high_water == 4
    allocator.grow("c", 6 * BLOCK_SIZE)
    assert allocator.pool.high_water == 6


def test_out_of_room_returns_none_and_changes_nothing() -> None:
    allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    allocator.allocate("a", (NUM_BLOCKS - 1) * BLOCK_SIZE)
    assert allocator.allocate("b", 2 * BLOCK_SIZE) is None
    assert "b" not in allocator
    assert allocator.grow("a", (NUM_BLOCKS + 1) * BLOCK_SIZE) is None
    assert len(allocator.table("a")) == NUM_BLOCKS - 1
    assert allocator.num_free == 1
    allocator.check_integrity()


def test_grow_returns_only_new_ids_and_never_shrinks() -> None:
    allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    allocator.allocate("a", 4)
    assert allocator.grow("a", 4) == []
    assert allocator.grow("a", 9) == [2, 3]
    assert allocator.grow("a", 1) == []
    assert allocator.table("a") == [1, 2, 3]
    allocator.check_integrity()


def test_table_is_a_copy() -> None:
    allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    allocator.allocate("a", 4)
    allocator.table("a").append(7)
    assert allocator.table("a") == [1]


def test_double_free_raises_key_error_naming_the_owner() -> None:
    allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, name="decode")
    allocator.allocate("seq-7", 4)
    allocator.free("seq-7")
    with pytest.raises(KeyError, match="seq-7"):
        allocator.free("seq-7")
    assert allocator.num_free == NUM_BLOCKS
    allocator.check_integrity()


def test_allocate_to_an_existing_owner_raises_value_error() -> None:
    allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    allocator.allocate("a", 4)
    with pytest.raises(ValueError, match="'a'"):
        allocator.allocate("a", 4)


def test_grow_of_an_unknown_owner_raises_key_error() -> None:
    with pytest.raises(KeyError, match="ghost"):
        BlockAllocator(NUM_BLOCKS, BLOCK_SIZE).grow("ghost", 4)


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "field"), [(0, 4, "num_blocks"), (4, 0, "block_size")]
)
def test_bad_sizes_raise_value_error_naming_the_field(
    num_blocks: int, block_size: int, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        BlockAllocator(num_blocks, block_size)


def test_check_integrity_catches_a_block_in_two_tables() -> None:
    allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    allocator.allocate("a", 4)
    allocator.allocate("b", 4)
    allocator._tables["b"][0] = allocator._tables["a"][0]  # corrupt on purpose
    with pytest.raises(RuntimeError, match="two tables"):
        allocator.check_integrity()


class AllocatorMachine(RuleBasedStateMachine):
    """Any sequence of allocate / grow / free against a model of who holds how many tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
        self.num_tokens: dict[str, int] = {}  # the model: tokens each owner's table covers

    def _num_blocks_held(self) -> int:
        return sum(self.allocator.blocks_for(n) for n in self.num_tokens.values())

    @rule(owner=st.sampled_from("abcdefgh"), num_tokens=st.integers(1, 80))
    def allocate(self, owner: str, num_tokens: int) -> None:
        if owner in self.num_tokens:
            return
        fits = self._num_blocks_held() + self.allocator.blocks_for(num_tokens) <= NUM_BLOCKS
        num_free = self.allocator.num_free
        table = self.allocator.allocate(owner, num_tokens)
        if not fits:
            assert table is None and self.allocator.num_free == num_free
            return
        assert table is not None and len(table) == self.allocator.blocks_for(num_tokens)
        self.num_tokens[owner] = num_tokens

    @precondition(lambda self: bool(self.num_tokens))
    @rule(data=st.data(), num_tokens=st.integers(0, 80))
    def grow(self, data: st.DataObject, num_tokens: int) -> None:
        owner = data.draw(st.sampled_from(sorted(self.num_tokens)))
        old_table = self.allocator.table(owner)
        target = max(num_tokens, self.num_tokens[owner])
        num_new = self.allocator.blocks_for(target) - len(old_table)
        num_free = self.allocator.num_free
        new_ids = self.allocator.grow(owner, num_tokens)
        if num_new > num_free:
            assert new_ids is None and self.allocator.table(owner) == old_table
            assert self.allocator.num_free == num_free
            return
        assert new_ids is not None and len(new_ids) == num_new
        assert self.allocator.table(owner) == old_table + new_ids
        self.num_tokens[owner] = target

    @precondition(lambda self: bool(self.num_tokens))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.num_tokens)))
        assert self.allocator.free(owner) == self.allocator.blocks_for(self.num_tokens.pop(owner))
        with pytest.raises(KeyError, match=owner):
            self.allocator.free(owner)

    @invariant()
    def totals_match_the_model(self) -> None:
        self.allocator.check_integrity()
        assert self.allocator.num_used == self._num_blocks_held()
        assert self.allocator.num_free + self.allocator.num_used == NUM_BLOCKS
        assert sorted(self.allocator.owners) == sorted(self.num_tokens)

    def teardown(self) -> None:
        for owner in list(self.num_tokens):
            self.allocator.free(owner)
        assert self.allocator.num_free == NUM_BLOCKS and not self.allocator.owners
        assert self.allocator.allocate("all", NUM_BLOCKS * BLOCK_SIZE) == list(
            range(1, NUM_BLOCKS + 1)
        )
        self.allocator.check_integrity()


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
test_allocator_state_machine = AllocatorMachine.TestCase


# -- stores sharing one KV tensor: quotas, hand-overs ------------------------------------
def test_a_hand_over_moves_the_table_and_its_quota_between_stores_of_one_pool() -> None:
    pool = BlockPool(12)
    scratch, cache = BlockAllocator(4, BLOCK_SIZE, "scratch", pool), BlockAllocator(
        8, BLOCK_SIZE, "cache", pool)
    assert scratch.shares_memory(cache) and not scratch.shares_memory(BlockAllocator(4, 4))
    table = scratch.allocate("a", 3 * BLOCK_SIZE + 1)  # 4 blocks: the whole quota
    assert table == [1, 2, 3, 4] and scratch.num_free == 0 and scratch.allocate("b", 1) is None
    assert cache.reserve("a", 3)  # its KV needs 3 of the 4 blocks (grown for the next token)
    assert cache.num_used == 3 and "a" not in cache  # room set aside, no table yet
    assert cache.adopt("a", scratch) == 3
    assert cache.table("a") == [1, 2, 3] and "a" not in scratch  # no copy: the same ids
    assert scratch.num_free == 4 and cache.num_used == 3
    assert scratch.allocate("b", 4 * BLOCK_SIZE) == [4, 5, 6, 7]  # the trimmed block came back
    scratch.check_integrity()
    cache.check_integrity()


def test_a_reservation_counts_against_the_quota_until_adopted_or_given_back() -> None:
    pool = BlockPool(6)
    src = BlockAllocator(4, BLOCK_SIZE, "src", pool)
    dst = BlockAllocator(2, BLOCK_SIZE, "dst", pool)
    src.allocate("a", 2 * BLOCK_SIZE)
    src.allocate("b", 2 * BLOCK_SIZE)
    assert dst.reserve("a", 2) and not dst.reserve("b", 1)  # dst's quota is taken
    assert dst.allocate("c", 1) is None
    with pytest.raises(ValueError, match="already"):
        dst.reserve("a", 1)
    assert dst.unreserve("a") == 2 and dst.num_free == 2
    with pytest.raises(KeyError, match="reserves no blocks"):
        dst.adopt("a", src)
    dst.check_integrity()


def test_quotas_cannot_exceed_the_pool() -> None:
    pool = BlockPool(8)
    BlockAllocator(6, BLOCK_SIZE, "a", pool)
    with pytest.raises(ValueError, match="exceed the shared pool"):
        BlockAllocator(3, BLOCK_SIZE, "b", pool)


def test_pool_integrity_sees_a_block_in_two_stores_tables() -> None:
    pool = BlockPool(8)
    a, b = BlockAllocator(4, BLOCK_SIZE, "a", pool), BlockAllocator(4, BLOCK_SIZE, "b", pool)
    a.allocate("x", BLOCK_SIZE)
    b.allocate("y", BLOCK_SIZE)
    b._tables["y"] = list(a._tables["x"])  # a corrupted table: the same block in two stores
    with pytest.raises(RuntimeError, match="two tables"):
        b.check_integrity()


STORES = {"prefill": 5, "host": 8, "staging": 4, "decode": 6}


class SharedPoolMachine(RuleBasedStateMachine):
    """Stores of one pool under any sequence of allocations, frees, and hand-overs reserved,
    then adopted or called off: no block is ever in two tables or lost, each store stays in
    its quota, and a hand-over keeps the owner's first blocks (its KV) in place."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(sum(STORES.values()))
        self.stores = {name: BlockAllocator(n, BLOCK_SIZE, name, self.pool)
                       for name, n in STORES.items()}
        self.where: dict[str, str] = {}  # owner -> store holding its table
        self.moving: dict[str, tuple[str, int]] = {}  # owner -> (destination, blocks)

    @rule(owner=st.sampled_from("abcdefgh"), store=st.sampled_from(sorted(STORES)),
          num_tokens=st.integers(1, 40))
    def allocate(self, owner: str, store: str, num_tokens: int) -> None:
        if owner in self.where:
            return
        allocator = self.stores[store]
        fits = allocator.blocks_for(num_tokens) <= allocator.num_free
        table = allocator.allocate(owner, num_tokens)
        assert (table is not None) == fits
        if table is not None:
            self.where[owner] = store

    @precondition(lambda self: bool(self.where))
    @rule(data=st.data(), num_tokens=st.integers(1, 40))
    def grow(self, data: st.DataObject, num_tokens: int) -> None:
        owner = data.draw(st.sampled_from(sorted(self.where)))
        if owner not in self.moving:
            self.stores[self.where[owner]].grow(owner, num_tokens)

    @precondition(lambda self: bool(self.where))
    @rule(data=st.data(), dst=st.sampled_from(sorted(STORES)))
    def reserve(self, data: st.DataObject, dst: str) -> None:
        owner = data.draw(st.sampled_from(sorted(self.where)))
        src = self.where[owner]
        if owner in self.moving or dst == src:
            return
        held = len(self.stores[src].table(owner))
        num_blocks = data.draw(st.integers(1, held))
        if self.stores[dst].reserve(owner, num_blocks):
            self.moving[owner] = (dst, num_blocks)

    @precondition(lambda self: bool(self.moving))
    @rule(data=st.data(), commit=st.booleans())
    def land(self, data: st.DataObject, commit: bool) -> None:
        owner = data.draw(st.sampled_from(sorted(self.moving)))
        dst, num_blocks = self.moving.pop(owner)
        if not commit:
            assert self.stores[dst].unreserve(owner) == num_blocks
            return
        kept = self.stores[self.where[owner]].table(owner)[:num_blocks]
        assert self.stores[dst].adopt(owner, self.stores[self.where[owner]]) == num_blocks
        assert self.stores[dst].table(owner) == kept
        self.where[owner] = dst

    @precondition(lambda self: bool(set(self.where) - set(self.moving)))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(set(self.where) - set(self.moving))))
        self.stores[self.where.pop(owner)].free(owner)

    @invariant()
    def books_balance(self) -> None:
        for allocator in self.stores.values():
            allocator.check_integrity()
            assert 0 <= allocator.num_free <= allocator.num_blocks
        held = sum(len(s.table(o)) for o, name in self.where.items() for s in [self.stores[name]])
        assert len(self.pool.free_ids) == self.pool.num_blocks - held


SharedPoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_shared_pool_state_machine = SharedPoolMachine.TestCase
