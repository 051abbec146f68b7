"""Helpers for transport tests: stores filled with distinct values, and a sequence's KV."""

from __future__ import annotations

import torch

from transport.kv import KVGeometry, KVStore


def make_store(
    name: str, geometry: KVGeometry, num_blocks: int, device: torch.device | str = "cpu"
) -> KVStore:
    """A store whose allocatable rows hold distinct values (row i starts at i * 1000)."""
    store = KVStore(name, geometry, num_blocks, torch.device(device))
    num_elements = store.tensor[1:].numel()
    values = torch.arange(num_elements, dtype=torch.float32).reshape(store.tensor[1:].shape)
    store.tensor[1:] = values.to(geometry.dtype) + 1000.0
    return store


def fill_seq(store: KVStore, seq_id: str, num_tokens: int, seed: int) -> torch.Tensor:
    """Allocates `seq_id` in `store`, writes random KV into its blocks, returns a clone of it."""
    block_ids = store.allocator.allocate(seq_id, num_tokens)
    assert block_ids is not None, f"{store.name} is full"
    generator = torch.Generator().manual_seed(seed)
    # [num_blocks, num_layers, 2, block_size, num_heads, head_dim]
    kv = torch.randn((len(block_ids), *store.geometry.block_shape), generator=generator)
    store.tensor[block_ids] = kv.to(store.device, store.geometry.dtype)
    return kv.to(store.geometry.dtype)


def read_seq(store: KVStore, seq_id: str) -> torch.Tensor:
    """The KV rows of `seq_id` in `store`, on the CPU."""
    return store.tensor[store.allocator.table(seq_id)].cpu()
