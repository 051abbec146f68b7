"""KV stores: one block-major KV tensor on one device plus the allocator of its blocks.

A decode cache, a prefill scratch cache, a staging buffer on the prefill device and the host KV
pool are all a `KVStore`; they differ only in device, size and pinning. No policy here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from transport.blocks import PAD_BLOCK_ID, BlockAllocator

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Shape of one KV block, shared by every store that exchanges blocks.

    The store tensor is `[num_blocks + 1, num_layers, 2, block_size, num_heads, head_dim]`:
    block-major, so one block of a request is contiguous across all layers and moving a
    request's KV is a gather/scatter of whole rows. K is index 0 of dim 2, V index 1.
    """

    num_layers: int  # decoder layers
    num_heads: int  # KV heads per layer
    head_dim: int  # channels per head
    block_size: int  # tokens per block
    dtype: torch.dtype  # element type of K and V

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_heads", "head_dim", "block_size"):
            value = getattr(self, field_name)
            if value < 1:
                raise ValueError(f"{field_name} ({value}) must be >= 1")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one row of a store tensor: [num_layers, 2, block_size, num_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_heads, self.head_dim)

    def blocks_in(self, num_bytes: int, what: str) -> int:
        """Whole blocks in `num_bytes` of `what` (a setting's name, for the error).

        Raises:
            ValueError: fewer than one block.
        """
        if num_bytes < self.bytes_per_block:
            raise ValueError(f"{what} ({num_bytes} bytes) must hold >= 1 KV block "
                             f"({self.bytes_per_block} bytes)")
        return num_bytes // self.bytes_per_block

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V for one block across all layers."""
        num_elements = 2 * self.num_layers * self.block_size * self.num_heads * self.head_dim
        return num_elements * self.dtype.itemsize


class KVStore:
    """One KV tensor on one device plus its allocator: a decode cache, a prefill scratch
    cache, a staging buffer on the prefill device, or the host pool.

    Row `PAD_BLOCK_ID` (0) is the null block: zeros, never allocated; rows 1..num_blocks are
    handed out by `allocator`. Only the null block is zeroed; the rest is `torch.empty`, so a
    large host pool costs resident memory only as it fills.
    """

    def __init__(
        self,
        name: str,
        geometry: KVGeometry,
        num_blocks: int,
        device: torch.device | str,
        pin_memory: bool = False,
        *,
        allocator: BlockAllocator | None = None,
        tensor: torch.Tensor | None = None,
    ) -> None:
        """Allocates the store tensor, or shares `tensor` (see `stores_for`).

        Args:
            pin_memory: page-lock a CPU store so host<->device copies are asynchronous. Honoured
                only when CUDA is available; otherwise the store is left pageable and a message
                is logged.
            allocator, tensor: a store in a shared KV tensor: its allocator (drawing from the
                tensor's `BlockPool`) and the tensor itself.
        Raises:
            ValueError: `num_blocks` < 1, or `pin_memory` asked for a non-CPU device.
        """
        device = torch.device(device)
        if num_blocks < 1:
            raise ValueError(f"num_blocks ({num_blocks}) of KV store {name!r} must be >= 1")
        self.name = name
        self.geometry = geometry
        self.allocator = (allocator if allocator is not None  # NOTE: an empty one is falsy
                          else BlockAllocator(num_blocks, geometry.block_size, name=name))
        if tensor is None:
            self.is_pinned = _resolve_pinning(name, device, pin_memory)
            tensor = self.new_tensor(geometry, num_blocks, device, self.is_pinned)
        else:
            self.is_pinned = tensor.device.type == "cpu" and tensor.is_pinned()
        # [pool blocks + 1, num_layers, 2, block_size, num_heads, head_dim]
        self.tensor = tensor
        self.device = self.tensor.device  # NOTE: `cuda` resolved to `cuda:N`, for comparisons

    @staticmethod
    def new_tensor(geometry: KVGeometry, num_blocks: int, device: torch.device | str,
                   pin_memory: bool = False) -> torch.Tensor:
        """A KV tensor of `num_blocks` blocks plus the null block (the only one zeroed)."""
        tensor = torch.empty((num_blocks + 1, *geometry.block_shape), dtype=geometry.dtype,
                             device=device, pin_memory=pin_memory)
        tensor[PAD_BLOCK_ID].zero_()
        return tensor

    @classmethod
    def with_capacity_bytes(
        cls,
        name: str,
        geometry: KVGeometry,
        num_bytes: int,
        device: torch.device | str,
        pin_memory: bool = False,
    ) -> KVStore:
        """A store of floor(num_bytes / bytes_per_block) allocatable blocks (the host pool is
        sized in bytes); the null block comes on top of that.

        Raises:
            ValueError: `num_bytes` is smaller than one block.
        """
        num_blocks = geometry.blocks_in(num_bytes, f"KV store {name!r}")
        return cls(name, geometry, num_blocks, device, pin_memory=pin_memory)

    def __repr__(self) -> str:
        return (
            f"KVStore(name={self.name!r}, device={self.device}, num_blocks={self.num_blocks}, "
            f"num_free={self.allocator.num_free}, is_pinned={self.is_pinned})"
        )

    @property
    def num_blocks(self) -> int:
        """Allocatable blocks (the null block excluded)."""
        return self.allocator.num_blocks

    @property
    def num_bytes(self) -> int:
        """Bytes of the allocatable blocks."""
        return self.num_blocks * self.geometry.bytes_per_block

    @property
    def num_used_bytes(self) -> int:
        """Bytes of the blocks held by some owner."""
        return self.allocator.num_used * self.geometry.bytes_per_block


def _resolve_pinning(name: str, device: torch.device, pin_memory: bool) -> bool:
    """Whether to pin a store: only CPU stores, and only when CUDA can use the pinning."""
    if not pin_memory:
        return False
    if device.type != "cpu":
        raise ValueError(f"pin_memory=True for KV store {name!r} needs a cpu device, got {device}")
    if not torch.cuda.is_available():
        logger.info("KV store %s: CUDA is not available, host memory left pageable", name)
        return False
    return True


def stores_for(layout: Mapping[str, tuple[str, int]], allocators: Mapping[str, BlockAllocator],
               geometry: KVGeometry, pin_host: bool = False,
               advise: Callable[[torch.Tensor], object] | None = None) -> dict[str, KVStore]:
    """The stores of `layout` (name -> (device, blocks)) over their `allocators`: one
    tensor per `BlockPool`, shared by the stores that draw from it; the one holding the
    `host` pool pinned with `pin_host`; `advise` called on each one holding a prefill or
    decode cache (the engine's huge-page advice)."""
    tensors: dict[int, torch.Tensor] = {}
    stores = {}
    for name, (device, num_blocks) in layout.items():
        pool = allocators[name].pool
        if id(pool) not in tensors:
            members = [m.name for m in pool.members]
            tensors[id(pool)] = KVStore.new_tensor(geometry, pool.num_blocks, device,
                                                   pin_memory=pin_host and "host" in members)
            if advise is not None and any(m.startswith(("prefill", "decode")) for m in members):
                advise(tensors[id(pool)])
        stores[name] = KVStore(name, geometry, num_blocks, device, allocator=allocators[name],
                               tensor=tensors[id(pool)])
    return stores
