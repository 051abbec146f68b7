"""The block tables of every KV store, and the bookkeeping of a KV move."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aserve.cores.base import Move
from aserve.engine.sequence import SeqState, TransferRecord
from scheduler import ceil_div
from transport.blocks import allocators_for

LOCATIONS = ("prefill", "staging", "host", "decode")


def kv_stores(prefill_devices: Sequence[str], decode_devices: Sequence[str],
              cache: Any, host_blocks: int) -> dict[str, tuple[str, int]]:
    """Every KV store, by name, with its device and its blocks (from `cache`, the engine's
    CacheConfig or the simulator's cluster): `prefill{i}` scratch on prefill device i;
    decode instance j's cache `decode{j}` and its candidate buffer `staging{j}` on prefill
    device j mod P (the paper's layout); the `host` pool of `host_blocks` in CPU memory. One
    layout, both drivers."""
    stores = {f"prefill{i}": (dev, cache.num_prefill_blocks)
              for i, dev in enumerate(prefill_devices)}
    for j, dev in enumerate(decode_devices):
        stores[f"decode{j}"] = (dev, cache.num_decode_blocks)
        stores[f"staging{j}"] = (prefill_devices[j % len(prefill_devices)],
                                 max(cache.num_staging_blocks, 1))
    stores["host"] = ("cpu", host_blocks)
    return stores


def keep_bounded(trace: list[Any], item: object, limit: int | None) -> int:
    """Appends `item` to `trace`; past `limit` the older half is dropped (a long-running
    server must not grow forever). Returns how many were dropped."""
    trace.append(item)
    if limit is None or len(trace) <= limit:
        return 0
    half = limit // 2
    del trace[:half]
    return half


# -- kv -------------------------------------------------------------------------------
# BlockLedger: the block tables of every KV store of one engine (or simulated cluster), by
# store name, and the bookkeeping of a KV move (reserve, then commit or cancel).
#
# Integers only: the engine's KVSpace (aserve/engine/actors.py) adds the tensors and the copies.


class BlockLedger:
    """`prefill{i}` scratch, `staging{j}` candidate buffers, one `host` pool, `decode{j}`
    caches. A sequence's `location` names the store whose table holds its KV."""

    def __init__(self, stores: Mapping[str, tuple[str, int]], block_size: int,
                 share_memory: bool, trace_limit: int | None = None) -> None:
        """An allocator per store of `stores` (`kv_stores`); with `share_memory` the stores
        on one device draw from one `BlockPool` (one KV tensor), each within its own
        blocks, and a move between two of them is a hand-over. At most `trace_limit`
        transfer records are kept (the older half is dropped past it); None keeps all."""
        self.allocators = allocators_for(stores, block_size, share_memory)
        self.block_size = block_size
        self.transfers: list[TransferRecord] = []  # completed moves, oldest first
        self.trace_limit = trace_limit
        self.num_transfers = 0  # every completed move, dropped records included

    def blocks_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def free_blocks(self, name: str) -> int:
        return self.allocators[name].num_free

    def allocate(self, seq: SeqState, name: str, num_tokens: int) -> bool:
        """Gives `seq` fresh blocks in store `name`; False (nothing changed) when full."""
        assert not seq.location, f"{seq.seq_id} already holds KV in {seq.location}"
        if self.allocators[name].allocate(seq.seq_id, num_tokens) is None:
            return False
        seq.location = name
        return True

    def grow(self, seq: SeqState, num_tokens: int) -> bool:
        """Extends `seq`'s table in its store to cover `num_tokens`; False when full."""
        return self.allocators[seq.location].grow(seq.seq_id, num_tokens) is not None

    def table(self, seq: SeqState) -> list[int]:
        return self.allocators[seq.location].table(seq.seq_id)

    def release(self, seq: SeqState) -> None:
        """Frees every block `seq` holds, wherever it is; a no-op when it holds none."""
        if seq.location:
            self.allocators[seq.location].free(seq.seq_id)
            seq.location = ""

    def reserve(self, seq: SeqState, dst: str, parent: SeqState | None = None) -> Move | None:
        """Allocates room for `seq`'s KV (its `num_computed_tokens` entries) in store `dst`;
        None (nothing changed) when `dst` is full. The source keeps the KV until `commit`.
        Where both stores share one KV tensor, the room is only reserved (a hand-over).

        With `parent` (a fork: n samples of one prompt share its prefill), `seq` holds no KV
        yet and gets a copy of the parent's first entries in the parent's store, `dst`. The
        move's source ids are taken now: the driver copies before anything allocates in
        that store again, even if the parent has finished (and freed its blocks) meanwhile.
        """
        source = parent or seq
        assert source.location and seq.location != dst, f"{seq.seq_id}: bad move to {dst}"
        taken = self.allocators[dst].take(seq.seq_id, max(seq.num_computed_tokens, 1),
                                          None if parent else self.allocators[seq.location])
        if taken is None:
            return None
        num_blocks, handover = taken
        src_ids = tuple(self.table(parent)[:num_blocks]) if parent else None
        return Move(seq, source.location, dst, num_blocks, src_ids, handover)

    def tables(self, move: Move) -> tuple[list[int], list[int]]:
        """(source ids, destination ids) of a copy `move`, aligned block for block."""
        dst_ids = self.allocators[move.dst].table(move.seq.seq_id)
        if move.src_ids is not None:
            return list(move.src_ids), dst_ids
        return self.allocators[move.src].table(move.seq.seq_id)[: len(dst_ids)], dst_ids

    def commit(self, move: Move, start_time: float, end_time: float) -> None:
        """The copy landed: the source blocks are freed (a fork's belong to its parent and
        stay) and `seq` lives in `dst`; a hand-over's table changes stores."""
        if move.handover:
            self.allocators[move.dst].adopt(move.seq.seq_id, self.allocators[move.src])
        elif move.src_ids is None:
            self.allocators[move.src].free(move.seq.seq_id)
        move.seq.location = move.dst
        self.num_transfers += 1
        keep_bounded(self.transfers, TransferRecord(move.seq.seq_id, move.src, move.dst,
                                                    move.num_blocks, start_time, end_time),
                     self.trace_limit)

    def cancel(self, move: Move) -> None:
        """The copy failed: the destination blocks are freed, the source keeps the KV (a
        fork then holds none)."""
        self.allocators[move.dst].free(move.seq.seq_id)  # a hand-over's reservation too

    def limits(self, uses_pool: bool) -> dict[str, int]:
        """The most blocks one request may hold, by the setting that sets it: every store it
        passes through, or it could never finish. NOTE: one above the batch share of decode
        KV gets the whole cache, and one larger than the staging buffer stays in the host pool
        until admitted (so staging sets no limit)."""
        stores = {"num_decode_blocks": "decode0"}
        if uses_pool:
            stores |= {"num_prefill_blocks": "prefill0", "the host pool": "host"}
        return {name: self.allocators[store].num_blocks for name, store in stores.items()}

    def check_fits(self, num_tokens: int, uses_pool: bool, what: str) -> None:
        """Raises ValueError naming `what` and the limit when `num_tokens` exceed one."""
        num_blocks = self.blocks_for(num_tokens)
        for name, limit in self.limits(uses_pool).items():
            if num_blocks > limit:
                raise ValueError(f"{what} ({num_tokens} tokens) needs {num_blocks} KV blocks "
                                 f"but {name} is {limit}")

    def usage(self) -> dict[str, tuple[int, int]]:
        """(used, total) blocks per location kind, summed over instances."""
        out = {loc: (0, 0) for loc in LOCATIONS}
        for name, allocator in self.allocators.items():
            kind = name.rstrip("0123456789")
            used, total = out[kind]
            out[kind] = (used + allocator.num_used, total + allocator.num_blocks)
        return out

    def blocks_touched(self) -> int:
        """Blocks ever handed out, over every KV tensor (each tensor's high-water mark):
        on a CPU, the KV memory that is resident, since tensors fault in as blocks are
        first written."""
        pools = {id(a.pool): a.pool for a in self.allocators.values()}
        return sum(pool.high_water for pool in pools.values())

    def blocks_used(self) -> dict[str, int]:
        return {loc: used for loc, (used, _) in self.usage().items()}

    def check_integrity(self) -> None:
        for allocator in self.allocators.values():
            allocator.check_integrity()


