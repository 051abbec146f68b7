"""BlockLedger: the block tables of every KV store of one engine (or simulated cluster), by
store name, and the bookkeeping of a KV move (reserve, then commit or cancel).

Integers only: the engine's KVSpace adds the tensors and the copies on top.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from aserve.core import Sequence, TransferRecord
from aserve.cores.base import Move
from scheduler import ceil_div
from transport.blocks import BlockAllocator

LOCATIONS = ("prefill", "staging", "host", "decode")


class BlockLedger:
    """`prefill{i}` scratch, `staging{j}` candidate buffers, one `host` pool, `decode{j}`
    caches. A sequence's `location` names the store whose table holds its KV."""

    def __init__(self, allocators: Mapping[str, BlockAllocator], block_size: int) -> None:
        self.allocators = dict(allocators)
        self.block_size = block_size
        self.transfers: list[TransferRecord] = []  # every completed move, for research

    def blocks_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def free_blocks(self, name: str) -> int:
        return self.allocators[name].num_free

    def allocate(self, seq: Sequence, name: str, num_tokens: int) -> bool:
        """Gives `seq` fresh blocks in store `name`; False (nothing changed) when full."""
        assert not seq.location, f"{seq.seq_id} already holds KV in {seq.location}"
        if self.allocators[name].allocate(seq.seq_id, num_tokens) is None:
            return False
        seq.location = name
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Extends `seq`'s table in its store to cover `num_tokens`; False when full."""
        return self.allocators[seq.location].grow(seq.seq_id, num_tokens) is not None

    def table(self, seq: Sequence) -> list[int]:
        return self.allocators[seq.location].table(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        """Frees every block `seq` holds, wherever it is; a no-op when it holds none."""
        if seq.location:
            self.allocators[seq.location].free(seq.seq_id)
            seq.location = ""

    def reserve(self, seq: Sequence, dst: str) -> Move | None:
        """Allocates room for `seq`'s KV (its `num_computed_tokens` entries) in store `dst`;
        None (nothing changed) when `dst` is full. The source keeps the KV until `commit`."""
        assert seq.location and seq.location != dst, f"{seq.seq_id}: bad move to {dst}"
        dst_ids = self.allocators[dst].allocate(seq.seq_id, max(seq.num_computed_tokens, 1))
        return None if dst_ids is None else Move(seq, seq.location, dst, len(dst_ids))

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> Move | None:
        """Gives `child` blocks in `parent`'s store for a copy of the parent's first
        `num_tokens` KV entries (n samples of one prompt share its prefill); None (nothing
        changed) when the store is full. The move's source ids are taken now: the driver
        copies before anything allocates in that store again, even if the parent has
        finished (and freed its blocks) meanwhile."""
        assert not child.location, f"{child.seq_id} already holds KV in {child.location}"
        allocator = self.allocators[parent.location]
        dst_ids = allocator.allocate(child.seq_id, max(num_tokens, 1))
        if dst_ids is None:
            return None
        child.location = parent.location
        src_ids = tuple(allocator.table(parent.seq_id)[: len(dst_ids)])
        return Move(child, parent.location, parent.location, len(dst_ids), src_ids)

    def tables(self, move: Move) -> tuple[list[int], list[int]]:
        """(source ids, destination ids) of `move`, aligned block for block."""
        dst_ids = self.allocators[move.dst].table(move.seq.seq_id)
        if move.src_ids is not None:
            return list(move.src_ids), dst_ids
        return self.allocators[move.src].table(move.seq.seq_id)[: len(dst_ids)], dst_ids

    def commit(self, move: Move, start_time: float, end_time: float) -> None:
        """The copy landed: the source blocks are freed (a fork's belong to its parent and
        stay) and `seq` lives in `dst`."""
        if move.src_ids is None:
            self.allocators[move.src].free(move.seq.seq_id)
        move.seq.location = move.dst
        self.transfers.append(TransferRecord(move.seq.seq_id, move.src, move.dst,
                                             move.num_blocks, start_time, end_time))

    def cancel(self, move: Move) -> None:
        """The copy failed: the destination blocks are freed, the source keeps the KV (a
        fork then holds none)."""
        if move.src_ids is not None:
            self.release(move.seq)
            return
        self.allocators[move.dst].free(move.seq.seq_id)

    def usage(self) -> dict[str, tuple[int, int]]:
        """(used, total) blocks per location kind, summed over instances."""
        out = {loc: (0, 0) for loc in LOCATIONS}
        for name, allocator in self.allocators.items():
            kind = re.sub(r"\d+$", "", name)
            used, total = out[kind]
            out[kind] = (used + allocator.num_used, total + allocator.num_blocks)
        return out

    def blocks_used(self) -> dict[str, int]:
        return {loc: used for loc, (used, _) in self.usage().items()}

    def check_integrity(self) -> None:
        for allocator in self.allocators.values():
            allocator.check_integrity()
