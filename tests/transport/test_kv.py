"""KVGeometry and KVStore: byte sizes, capacity from bytes, the null block, pinning fallback."""

from __future__ import annotations

import pytest
import torch

from transport.blocks import PAD_BLOCK_ID
from transport.kv import KVGeometry, KVStore


def test_bytes_per_block_counts_k_and_v_of_every_layer() -> None:
    geometry = KVGeometry(
        num_layers=3, num_heads=4, head_dim=16, block_size=8, dtype=torch.bfloat16
    )
    assert geometry.bytes_per_block == 3 * 2 * 8 * 4 * 16 * 2


def test_store_tensor_is_block_major_with_a_null_row(geometry: KVGeometry) -> None:
    store = KVStore("decode", geometry, num_blocks=5, device="cpu")
    assert store.tensor.shape == (6, 2, 2, 4, 2, 8)
    assert store.tensor.dtype == torch.float32
    assert bool((store.tensor[PAD_BLOCK_ID] == 0).all())
    assert store.num_blocks == store.allocator.num_blocks == 5
    assert store.num_bytes == 5 * geometry.bytes_per_block


@pytest.mark.parametrize("num_extra_bytes", [0, 1, -1])
def test_with_capacity_bytes_gives_floor_of_bytes_per_block(
    geometry: KVGeometry, num_extra_bytes: int
) -> None:
    num_bytes = 7 * geometry.bytes_per_block + num_extra_bytes
    store = KVStore.with_capacity_bytes("pool", geometry, num_bytes, "cpu")
    assert store.num_blocks == num_bytes // geometry.bytes_per_block
    assert store.tensor.shape[0] == store.num_blocks + 1
    assert store.num_bytes <= num_bytes


def test_with_capacity_below_one_block_raises_value_error(geometry: KVGeometry) -> None:
    with pytest.raises(ValueError, match="KV store 'pool' .* must hold >= 1 KV block"):
        KVStore.with_capacity_bytes("pool", geometry, geometry.bytes_per_block - 1, "cpu")
    with pytest.raises(ValueError, match="host_pool_gb .* must hold >= 1 KV block"):
        geometry.blocks_in(10, "host_pool_gb")


def test_pin_memory_without_cuda_falls_back_to_pageable(geometry: KVGeometry) -> None:
    store = KVStore("pool", geometry, num_blocks=4, device="cpu", pin_memory=True)
    assert store.is_pinned == torch.cuda.is_available()
    assert store.tensor.is_pinned() == store.is_pinned


def test_used_bytes_follow_the_allocator(geometry: KVGeometry) -> None:
    store = KVStore("pool", geometry, num_blocks=4, device="cpu")
    store.allocator.allocate("a", 9)
    assert store.num_used_bytes == 3 * geometry.bytes_per_block


@pytest.mark.parametrize("field", ["num_layers", "num_heads", "head_dim", "block_size"])
def test_geometry_rejects_non_positive_sizes(field: str) -> None:
    sizes = {"num_layers": 1, "num_heads": 1, "head_dim": 1, "block_size": 1, field: 0}
    with pytest.raises(ValueError, match=field):
        KVGeometry(**sizes, dtype=torch.float16)


def test_store_rejects_zero_blocks(geometry: KVGeometry) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVStore("decode", geometry, num_blocks=0, device="cpu")
