"""Block allocator over the integer block ids of one KV store, and the only writer of block tables.

Pure Python: imports no torch and no asyncio, so it runs and is tested anywhere.
"""

from __future__ import annotations

import heapq

PAD_BLOCK_ID = 0  # the reserved null block (all zeros) that padded block tables point to


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

    Not thread-safe: one thread (the owning actor's) drives an allocator.
    """

    def __init__(self, num_blocks: int, block_size: int, name: str = "") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size ({block_size}) must be >= 1")
        self.name = name
        self._num_blocks = num_blocks
        self._block_size = block_size
        # NOTE: an ascending list is already a valid min-heap; block 0 is PAD_BLOCK_ID.
        self._free_ids: list[int] = list(range(PAD_BLOCK_ID + 1, num_blocks + 1))
        self._tables: dict[str, list[int]] = {}

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
    def num_free(self) -> int:
        """Blocks not in any table."""
        return len(self._free_ids)

    @property
    def num_used(self) -> int:
        """Blocks held by some owner."""
        return self._num_blocks - len(self._free_ids)

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
        return num_blocks <= len(self._free_ids)

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
        block_ids = self._table_of(owner)
        del self._tables[owner]
        for block_id in block_ids:
            heapq.heappush(self._free_ids, block_id)
        return len(block_ids)

    def check_integrity(self) -> None:
        """Raises RuntimeError unless free + used == total, no block is in two tables, no free
        block is in a table, and every id is in 1..num_blocks."""
        num_in_tables = sum(len(table) for table in self._tables.values())
        num_free = len(self._free_ids)
        if num_free + num_in_tables != self._num_blocks:
            raise RuntimeError(
                f"allocator {self.name!r}: free ({num_free}) + used ({num_in_tables}) "
                f"!= total ({self._num_blocks})"
            )
        used_ids = {block_id for table in self._tables.values() for block_id in table}
        if len(used_ids) != num_in_tables:
            raise RuntimeError(
                f"allocator {self.name!r}: {num_in_tables - len(used_ids)} blocks are in two "
                f"tables ({len(used_ids)} distinct of {num_in_tables} used)"
            )
        free_ids = set(self._free_ids)
        if len(free_ids) != num_free or free_ids & used_ids:
            raise RuntimeError(
                f"allocator {self.name!r}: {len(free_ids & used_ids)} free blocks are in tables, "
                f"{num_free - len(free_ids)} are free twice"
            )
        if (free_ids | used_ids) != set(range(PAD_BLOCK_ID + 1, self._num_blocks + 1)):
            raise RuntimeError(f"allocator {self.name!r}: block ids outside 1..{self._num_blocks}")

    def _table_of(self, owner: str) -> list[int]:
        table = self._tables.get(owner)
        if table is None:
            raise KeyError(f"owner {owner!r} holds no blocks in allocator {self.name!r}")
        return table

    def _pop(self, num_blocks: int) -> list[int] | None:
        """Takes the `num_blocks` lowest free ids (ascending), or None when too few are free."""
        if num_blocks > len(self._free_ids):
            return None
        return [heapq.heappop(self._free_ids) for _ in range(num_blocks)]
