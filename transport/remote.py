"""KV blocks between nodes: the stores one node holds (`NodeStores`), its blocks packed
into a host array for the move, and the inter-node transport interface with its Ray
object-store backend. Mechanism only: which blocks move where is decided by the caller.

A move between nodes is `export_blocks` on the source node (a gather of whole block rows
into one contiguous array), a transfer, and `import_blocks` on the destination (a scatter
into its rows). The Ray backend returns the array from the source's actor method, so it
lands in the object store; the destination's call takes the object reference, and Ray
pulls it to the destination node and maps it there without a copy (numpy arrays are
zero-copy reads). A faster backend (NIXL or UCX over RDMA) implements `InterNodeTransport`
and reads and writes the same rows; nothing above transport/ changes.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from transport.blocks import allocators_for
from transport.copy import CopyEngine, block_runs
from transport.kv import KVGeometry, KVStore, stores_for

if TYPE_CHECKING:
    from ray.actor import ActorHandle

# numpy has no bfloat16: such blocks travel as their raw 16-bit patterns
_CARRIER = {torch.bfloat16: torch.int16}


def pack(store: KVStore, block_ids: list[int]) -> np.ndarray:
    """Blocks `block_ids` of `store` as one contiguous host array (a gather of whole rows):
    [num_blocks, num_layers, 2, block_size, num_heads, head_dim]."""
    index = torch.tensor(block_ids, dtype=torch.long, device=store.device)
    rows = store.tensor.index_select(0, index).cpu()  # [n, L, 2, B, H, D]
    return rows.view(_CARRIER.get(rows.dtype, rows.dtype)).numpy()


def unpack(store: KVStore, block_ids: list[int], rows: np.ndarray) -> None:
    """Writes `rows` (from `pack`) into blocks `block_ids` of `store`."""
    if len(block_ids) != rows.shape[0]:
        raise ValueError(f"{rows.shape[0]} packed blocks for {len(block_ids)} block ids "
                         f"of store {store.name!r}")
    with warnings.catch_warnings():  # a zero-copy object-store array is read-only; only read
        warnings.simplefilter("ignore", UserWarning)
        src = torch.from_numpy(rows).view(store.tensor.dtype)  # [n, L, 2, B, H, D]
    if store.device.type != "cpu":
        src = src.to(store.device)
    for start, dst_start, count in block_runs(list(range(len(block_ids))), block_ids):
        store.tensor[dst_start:dst_start + count].copy_(src[start:start + count])


class NodeStores:
    """The KV stores of one node (a subset of an engine's layout), with their tensors: the
    destination and source of every KV move that touches the node. Block ids are the
    engine's: its ledger allocates them (the allocators built here only size the tensors,
    grouped as the ledger groups them)."""

    def __init__(self, layout: Mapping[str, tuple[str, int]], geometry: KVGeometry,
                 share_memory: bool) -> None:
        allocators = allocators_for(layout, geometry.block_size, share_memory)
        self.stores = stores_for(layout, allocators, geometry)
        self._engines: dict[tuple[str, str], CopyEngine] = {}  # by (src, dst) device

    def __getitem__(self, name: str) -> KVStore:
        return self.stores[name]

    def export_blocks(self, store: str, block_ids: list[int]) -> np.ndarray:
        return pack(self.stores[store], block_ids)

    def import_blocks(self, store: str, block_ids: list[int], rows: np.ndarray) -> int:
        """Writes packed rows into `store`; returns the bytes written."""
        unpack(self.stores[store], block_ids, rows)
        return int(rows.nbytes)

    def copy_blocks(self, src: str, src_ids: list[int], dst: str, dst_ids: list[int]) -> None:
        """A move between two stores of this node (separate tensors), on the node's own copy
        path (transport/copy.py)."""
        src_store, dst_store = self.stores[src], self.stores[dst]
        key = (str(src_store.device), str(dst_store.device))
        if key not in self._engines:
            self._engines[key] = CopyEngine(*key)
        self._engines[key].copy(src_store, src_ids, dst_store, dst_ids).wait()


class InterNodeTransport(Protocol):
    """Moves KV blocks from a store on one node to a store on another. `src` and `dst`
    are the nodes' endpoints (for Ray: the actors holding their `NodeStores`)."""

    async def send(self, src: Any, src_store: str, src_ids: list[int],
                   dst: Any, dst_store: str, dst_ids: list[int]) -> int:
        """Copies the blocks and returns the bytes moved once they are in place."""
        ...


class ObjectStoreTransport:
    """Through Ray's object store: the source actor's `export_blocks` returns the packed
    rows (an object in its node's store); the destination actor's `import_blocks` receives
    the reference, and Ray moves the object between the nodes (zero-copy on CPU)."""

    async def send(self, src: ActorHandle, src_store: str, src_ids: list[int],
                   dst: ActorHandle, dst_store: str, dst_ids: list[int]) -> int:
        rows = src.export_blocks.remote(src_store, src_ids)
        return await dst.import_blocks.remote(dst_store, dst_ids, rows)  # type: ignore[no-any-return]
