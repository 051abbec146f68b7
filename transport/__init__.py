"""transport: KV memory and its movement (block allocator, KV stores, host pool, staging,
copy streams, peer copies). No policy; never imports models/, scheduler/ or aserve/.

`transport.blocks` is imported eagerly and stays torch-free; the torch parts load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from transport.blocks import PAD_BLOCK_ID, BlockAllocator

if TYPE_CHECKING:
    from transport.copy import CopyEngine, device_sync, move
    from transport.handle import CopyHandle
    from transport.kv import KVGeometry, KVStore

_LAZY_MODULES = {
    "CopyEngine": "transport.copy",
    "CopyHandle": "transport.handle",
    "KVGeometry": "transport.kv",
    "KVStore": "transport.kv",
    "device_sync": "transport.copy",
    "move": "transport.copy",
}

__all__ = [
    "PAD_BLOCK_ID",
    "BlockAllocator",
    "CopyEngine",
    "CopyHandle",
    "KVGeometry",
    "KVStore",
    "device_sync",
    "move",
]


def __getattr__(name: str) -> object:
    module_name = _LAZY_MODULES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'transport' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
