"""Block allocator over the integer block ids of one KV store, and the only writer of block tables.

Stores in one memory (the prefill scratch, staging buffer, host pool and decode cache of a
CPU-only engine; a GPU's scratch and staging) may share one KV tensor: their allocators then
draw ids from one `BlockPool`, each within its own quota, and a move between two of them
hands the block table over (`reserve`, then `adopt`) instead of copying the KV.

Pure Python: imports no torch and no asyncio, so it runs and is tested anywhere.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

PAD_BLOCK_ID = 0  # the reserved null block (all zeros) that padded block tables point to


class BlockPool:
    """The free ids of one KV tensor (1..num_blocks), shared by the allocators of the stores
    that live in it; a pool of its own for a store alone."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 1")
        self.num_blocks = num_blocks
        # NOTE: an ascending list is already a valid min-heap; block 0 is PAD_BLOCK_ID.
        self.free_ids: list[int] = list(range(PAD_BLOCK_ID + 1, num_blocks + 1))
        self.members: list[BlockAllocator] = []
        # the highest id ever handed out: ids are taken lowest first, so the blocks of a
        # lazily allocated tensor that were ever written are 1..high_water
        self.high_water = PAD_BLOCK_ID

    def check_integrity(self) -> None:
        """Raises RuntimeError unless every id of 1..num_blocks is either free or in exactly
        one table of one member, and no id is free twice."""
        tables = [table for member in self.members for table in member._tables.values()]
        used = [block_id for table in tables for block_id in table]
        used_ids, free_ids = set(used), set(self.free_ids)
        names = ", ".join(repr(m.name) for m in self.members)
        if len(used_ids) != len(used):
            raise RuntimeError(f"allocators {names}: {len(used) - len(used_ids)} blocks are in "
                               f"two tables ({len(used_ids)} distinct of {len(used)} used)")
        if len(free_ids) != len(self.free_ids) or free_ids & used_ids:
            raise RuntimeError(f"allocators {names}: {len(free_ids & used_ids)} free blocks are "
                               f"in tables, {len(self.free_ids) - len(free_ids)} are free twice")
        if (free_ids | used_ids) != set(range(PAD_BLOCK_ID + 1, self.num_blocks + 1)):
            raise RuntimeError(f"allocators {names}: free ({len(free_ids)}) + used "
                               f"({len(used_ids)}) is not the ids 1..{self.num_blocks}")


class BlockAllocator:
    """Blocks 1..num_blocks of one KV store; block tables keyed by owner (a seq id).

    Only this class writes block tables; `table()` hands out copies. Running out of room is
    expected: `allocate` and `grow` return None and change nothing. A double free is a bug and
    raises KeyError naming the owner.

    NOTE: the free list is a min-heap, so the lowest free ids are handed out first. This keeps
    the used blocks packed at the low end of the KV tensor: a request's blocks tend to be
    ascending and adjacent (better locality for paged attention and for whole-row copies), and
    the high end of a large, lazily-zeroed host pool is never touched until it is needed, so the
    pool's resident memory follows its real use. The cost is O(log num_blocks) per block.

    With a shared `pool`, `num_blocks` is this store's quota of the pool's ids: the
    allocator holds (and reserves) at most that many, and the quotas of a pool's members add
    up to its size, so a member's allocation within quota always finds free ids.

    Not thread-safe: one thread (the owning actor's) drives an allocator.
    """

    def __init__(self, num_blocks: int, block_size: int, name: str = "",
                 pool: BlockPool | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size ({block_size}) must be >= 1")
        self.name = name
        self._num_blocks = num_blocks
        self._block_size = block_size
        self.pool = pool or BlockPool(num_blocks)
        quotas = num_blocks + sum(m.num_blocks for m in self.pool.members)
        if quotas > self.pool.num_blocks:
            raise ValueError(f"allocator {name!r}: quotas ({quotas} blocks) exceed the shared "
                             f"pool ({self.pool.num_blocks})")
        self.pool.members.append(self)
        self._free_ids = self.pool.free_ids
        self._tables: dict[str, list[int]] = {}
        self._reserved: dict[str, int] = {}  # owner -> blocks reserved for a hand-over
        self._num_used = 0  # blocks in tables + reserved

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(name={self.name!r}, num_blocks={self._num_blocks}, "
            f"block_size={self._block_size}, num_free={self.num_free})"
        )

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def num_blocks(self) -> int:
        """Allocatable blocks (the null block excluded)."""
        return self._num_blocks

    @property
    def block_ids(self) -> range:
        """The ids this store's tables may hold: every id of its pool. A shared pool's ids
        are anywhere in it; the quota bounds how many a store holds, not which."""
        return range(PAD_BLOCK_ID + 1, self.pool.num_blocks + 1)

    @property
    def num_free(self) -> int:
        """Blocks not in any table nor reserved (within this store's quota)."""
        return self._num_blocks - self._num_used

    @property
    def num_used(self) -> int:
        """Blocks held by some owner, or reserved for one."""
        return self._num_used

    @property
    def owners(self) -> list[str]:
        """Owners holding blocks, in allocation order."""
        return list(self._tables)

    def __contains__(self, owner: object) -> bool:
        return owner in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens ({num_tokens}) must be >= 0")
        return -(-num_tokens // self._block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether `num_blocks` more blocks are free now."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 0")
        return num_blocks <= self.num_free

    def shares_memory(self, other: BlockAllocator) -> bool:
        """Whether `other` draws from this allocator's pool (one KV tensor): a move between
        the two is a hand-over of the block table."""
        return other is not self and other.pool is self.pool

    def take(self, owner: str, num_tokens: int,
             src: BlockAllocator | None = None) -> tuple[int, bool] | None:
        """Room for `owner`'s `num_tokens` coming from store `src`: reserved for a hand-over
        where `src` shares this pool, else allocated for a copy (and with no `src`). Returns
        (blocks, is_hand_over), or None (no change) when there is not that much room."""
        if src is not None and self.shares_memory(src):
            num_blocks = self.blocks_for(num_tokens)
            return (num_blocks, True) if self.reserve(owner, num_blocks) else None
        block_ids = self.allocate(owner, num_tokens)
        return None if block_ids is None else (len(block_ids), False)

    def reserve(self, owner: str, num_blocks: int) -> bool:
        """Sets `num_blocks` of this store's quota aside for `owner`, whose table another
        store of the same pool holds (`adopt` takes it over); False (no change) when the
        quota has not that much room.

        Raises:
            ValueError: `owner` already holds or reserves blocks here.
        """
        if owner in self._tables or owner in self._reserved:
            raise ValueError(f"owner {owner!r} already holds blocks in allocator {self.name!r}")
        if not self.can_allocate(num_blocks):
            return False
        self._reserved[owner] = num_blocks
        self._num_used += num_blocks
        return True

    def adopt(self, owner: str, src: BlockAllocator) -> int:
        """Takes over `owner`'s table from `src` (same pool), its first reserved blocks; the
        rest of that table goes back to the pool. Returns the blocks taken over.

        Raises:
            KeyError: `owner` reserves nothing here or holds no blocks in `src`.
            ValueError: `src` is not of this pool, or its table is shorter than reserved.
        """
        if not self.shares_memory(src):
            raise ValueError(f"allocator {src.name!r} does not share {self.name!r}'s pool")
        num_blocks = self._reserved.get(owner)
        if num_blocks is None:
            raise KeyError(f"owner {owner!r} reserves no blocks in allocator {self.name!r}")
        table = src._table_of(owner)
        if len(table) < num_blocks:
            raise ValueError(f"owner {owner!r} holds {len(table)} blocks in {src.name!r}, "
                             f"fewer than the {num_blocks} reserved in {self.name!r}")
        del src._tables[owner]
        src._num_used -= len(table)
        for block_id in table[num_blocks:]:  # grown past its KV: back to the pool
            heapq.heappush(self._free_ids, block_id)
        del self._reserved[owner]
        self._tables[owner] = table[:num_blocks]
        return num_blocks

    def unreserve(self, owner: str) -> int:
        """Gives back what `reserve` set aside for `owner` (a hand-over called off).

        Raises:
            KeyError: `owner` reserves nothing here.
        """
        num_blocks = self._reserved.pop(owner)
        self._num_used -= num_blocks
        return num_blocks

    def allocate(self, owner: str, num_tokens: int) -> list[int] | None:
        """Gives a new owner a table covering `num_tokens` tokens.

        Returns:
            A copy of the new table, or None (and no change) when there is not enough room.
        Raises:
            ValueError: `owner` already holds blocks, or `num_tokens` < 1.
        """
        if owner in self._tables:
            raise ValueError(f"owner {owner!r} already holds blocks in allocator {self.name!r}")
        if num_tokens < 1:
            raise ValueError(f"num_tokens ({num_tokens}) must be >= 1")
        block_ids = self._pop(self.blocks_for(num_tokens))
        if block_ids is None:
            return None
        self._tables[owner] = block_ids
        return list(block_ids)

    def grow(self, owner: str, num_tokens: int) -> list[int] | None:
        """Extends `owner`'s table to cover `num_tokens` tokens (it never shrinks).

        Returns:
            The newly added ids ([] when none were needed), or None (and no change) when there
            is not enough room.
        Raises:
            KeyError: `owner` holds no blocks.
        """
        table = self._table_of(owner)
        block_ids = self._pop(max(0, self.blocks_for(num_tokens) - len(table)))
        if block_ids is None:
            return None
        table.extend(block_ids)
        return block_ids

    def table(self, owner: str) -> list[int]:
        """A copy of `owner`'s block table; KeyError when it holds none."""
        return list(self._table_of(owner))

    def free(self, owner: str) -> int:
        """Frees all of `owner`'s blocks and returns how many.

        Raises:
            KeyError: `owner` holds no blocks (a double free is a bug made loud).
        """
        if owner in self._reserved:  # a hand-over called off: its room goes back
            return self.unreserve(owner)
        block_ids = self._table_of(owner)
        del self._tables[owner]
        for block_id in block_ids:
            heapq.heappush(self._free_ids, block_id)
        self._num_used -= len(block_ids)
        return len(block_ids)

    def check_integrity(self) -> None:
        """Raises RuntimeError unless this store's tables and reservations add up to its used
        blocks within its quota, and its pool's ids are each free or in exactly one table of
        one member (`BlockPool.check_integrity`)."""
        num_in_tables = sum(len(table) for table in self._tables.values())
        num_reserved = sum(self._reserved.values())
        if num_in_tables + num_reserved != self._num_used or self._num_used > self._num_blocks:
            raise RuntimeError(
                f"allocator {self.name!r}: tables ({num_in_tables}) + reserved "
                f"({num_reserved}) != used ({self._num_used}), or over the quota "
                f"({self._num_blocks})"
            )
        self.pool.check_integrity()

    def _table_of(self, owner: str) -> list[int]:
        table = self._tables.get(owner)
        if table is None:
            raise KeyError(f"owner {owner!r} holds no blocks in allocator {self.name!r}")
        return table

    def _pop(self, num_blocks: int) -> list[int] | None:
        """Takes the `num_blocks` lowest free ids (ascending), or None when too few are free."""
        if num_blocks > self.num_free:
            return None
        self._num_used += num_blocks
        block_ids = [heapq.heappop(self._free_ids) for _ in range(num_blocks)]
        if block_ids:
            self.pool.high_water = max(self.pool.high_water, block_ids[-1])
        return block_ids


def allocators_for(stores: Mapping[str, tuple[str, int]], block_size: int,
                   share_memory: bool) -> dict[str, BlockAllocator]:
    """An allocator per store (name -> (device, blocks)); with `share_memory` the stores on
    one device draw from one `BlockPool` (one KV tensor), each within its own blocks."""
    totals: dict[str, int] = {}
    for device, num_blocks in stores.values():
        totals[device] = totals.get(device, 0) + num_blocks
    pools = {dev: BlockPool(n) for dev, n in totals.items()} if share_memory else {}
    return {name: BlockAllocator(n, block_size, name, pools.get(dev))
            for name, (dev, n) in stores.items()}
