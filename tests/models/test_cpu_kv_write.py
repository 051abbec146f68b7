"""The C KV write (models/cpu_kv_write.py) against a plain loop over the slots."""

from __future__ import annotations

import pytest
import torch

from models import cpu_kernels, cpu_kv_write
from models.attention import write_kv

pytestmark = pytest.mark.skipif(cpu_kv_write._library() is None, reason="no C compiler")

BLOCKS, LAYERS, BLOCK_SIZE = 40, 3, 16


def expected(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
    want = kv_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        want[slot // BLOCK_SIZE, layer, 0, slot % BLOCK_SIZE] = k[t]
        want[slot // BLOCK_SIZE, layer, 1, slot % BLOCK_SIZE] = v[t]
    return want


def fused(n: int, heads: int, dim: int, dtype: torch.dtype, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as strided views of one `[n, q + k + v]` projection, as the models make them."""
    qkv = torch.randn(n, 4 * heads, dim, generator=torch.Generator().manual_seed(seed))
    qkv = qkv.to(dtype)
    return qkv[:, 2 * heads:3 * heads], qkv[:, 3 * heads:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "heads", "dim"), [(1, 4, 32), (37, 3, 64), (600, 3, 64)])
def test_writes_each_row_to_its_slot_and_nothing_else(dtype: torch.dtype, n: int, heads: int,
                                                      dim: int) -> None:
    kv_cache = torch.randn(BLOCKS, LAYERS, 2, BLOCK_SIZE, heads, dim).to(dtype)
    k, v = fused(n, heads, dim, dtype, n)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(n))[:n]
    want = expected(kv_cache, 2, k, v, slots)
    assert cpu_kv_write.write(kv_cache, 2, k, v, slots)
    assert torch.equal(kv_cache, want)
    if n == 600:  # large enough to be shared out to the threads where there are several
        assert cpu_kernels.threads_for(k.numel()) == torch.get_num_threads()


def test_a_slot_outside_the_cache_raises_and_writes_nothing() -> None:
    kv_cache = torch.zeros(BLOCKS, LAYERS, 2, BLOCK_SIZE, 2, 32)
    k, v = fused(3, 2, 32, torch.float32, 0)
    for bad in (BLOCKS * BLOCK_SIZE, -1):
        with pytest.raises(IndexError, match=f"slot {bad} lies outside"):
            cpu_kv_write.write(kv_cache, 0, k, v, torch.tensor([0, bad, 5]))
        assert not kv_cache.any()


def test_declines_what_it_cannot_write_and_write_kv_still_does() -> None:
    kv_cache = torch.zeros(BLOCKS, LAYERS, 2, BLOCK_SIZE, 2, 32, dtype=torch.bfloat16)
    k, v = fused(5, 2, 32, torch.float32, 1)  # wider than the cache: rounded by torch's path
    slots = torch.tensor([3, 17, 18, 100, 639])
    assert not cpu_kv_write.write(kv_cache, 1, k, v, slots)
    assert not cpu_kv_write.write(kv_cache[:, :, :, :, :1], 1, k[:, :1].bfloat16(),
                                  v[:, :1].bfloat16(), slots)  # a cache view with gaps
    write_kv(kv_cache, 1, k, v, slots)
    assert torch.equal(kv_cache, expected(torch.zeros_like(kv_cache), 1, k.bfloat16(),
                                          v.bfloat16(), slots))
