"""CUDA copies: pinned host->device overlaps compute, device->device and device->host keep the
exact bytes, copies wait for the producer of the src blocks, and failures lose nothing."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
import torch

from tests.transport.helpers import fill_seq, read_seq
from transport.copy import CopyEngine, device_sync, move
from transport.kv import KVGeometry, KVStore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

logger = logging.getLogger(__name__)
HOST = torch.device("cpu")


@pytest.fixture
def cuda_geometry() -> KVGeometry:
    return KVGeometry(num_layers=4, num_heads=8, head_dim=64, block_size=16, dtype=torch.float16)


def _decode_device() -> torch.device:
    """The second GPU when there is one (a real peer copy), else the first one again."""
    return torch.device("cuda", 1 if torch.cuda.device_count() > 1 else 0)


@pytest.mark.parametrize("num_tokens", [16, 100])
def test_host_to_device_move_preserves_bytes(cuda_geometry: KVGeometry, num_tokens: int) -> None:
    pool = KVStore("pool", cuda_geometry, 32, HOST, pin_memory=True)
    cache = KVStore("decode", cuda_geometry, 32, "cuda:0")
    pool.allocator.allocate("other", 40)
    kv = fill_seq(pool, "seq", num_tokens, seed=1)
    handle = move("seq", num_tokens, pool, cache, CopyEngine(HOST, "cuda:0"))
    assert handle is not None
    handle.wait()
    assert torch.equal(read_seq(cache, "seq"), kv)
    assert "seq" not in pool.allocator
    assert handle.elapsed_time is not None and handle.elapsed_time > 0


@pytest.mark.parametrize("is_contiguous", [True, False])
def test_device_to_host_move_preserves_bytes(
    cuda_geometry: KVGeometry, is_contiguous: bool
) -> None:
    cache = KVStore("prefill", cuda_geometry, 32, "cuda:0")
    pool = KVStore("pool", cuda_geometry, 32, HOST, pin_memory=True)
    if not is_contiguous:  # leave holes so that the dst ids are not one ascending run
        for owner in ("a", "b", "c"):
            pool.allocator.allocate(owner, 16)
        pool.allocator.free("b")
    kv = fill_seq(cache, "seq", 70, seed=2)
    handle = move("seq", 70, cache, pool, CopyEngine("cuda:0", HOST))
    assert handle is not None
    handle.wait()
    assert torch.equal(read_seq(pool, "seq"), kv)
    assert cache.allocator.num_free == 32


def test_device_to_device_move_preserves_bytes(cuda_geometry: KVGeometry) -> None:
    staging = KVStore("staging", cuda_geometry, 32, "cuda:0")
    cache = KVStore("decode", cuda_geometry, 32, _decode_device())
    cache.allocator.allocate("other", 30)
    kv = fill_seq(staging, "seq", 90, seed=3)
    engine = CopyEngine("cuda:0", _decode_device())
    handle = move("seq", 90, staging, cache, engine)
    assert handle is not None
    handle.wait()
    assert torch.equal(read_seq(cache, "seq"), kv)
    assert "seq" not in staging.allocator


def test_copy_waits_for_the_producer_of_src(cuda_geometry: KVGeometry) -> None:
    cache = KVStore("prefill", cuda_geometry, 32, "cuda:0")
    pool = KVStore("pool", cuda_geometry, 32, HOST, pin_memory=True)
    block_ids = cache.allocator.allocate("seq", 64)
    assert block_ids is not None
    x = torch.randn(4096, 4096, device="cuda:0")  # [4096, 4096]
    for _ in range(20):  # keep the producer (current) stream busy before the write
        x = torch.tanh(x @ x)
    cache.tensor[block_ids] = x.mean().to(torch.float16)  # written last, on the current stream
    handle = move("seq", 64, cache, pool, CopyEngine("cuda:0", HOST))
    assert handle is not None
    handle.wait()
    expected = cache.tensor[block_ids].cpu()  # freed, but nothing has overwritten it
    assert torch.equal(read_seq(pool, "seq"), expected)


def test_failing_cuda_copy_leaves_src_and_dst_unchanged(cuda_geometry: KVGeometry) -> None:
    pool = KVStore("pool", cuda_geometry, 8, HOST, pin_memory=True)
    cache = KVStore("decode", cuda_geometry, 8, "cuda:0")
    kv = fill_seq(pool, "seq", 40, seed=4)
    engine = CopyEngine(HOST, "cuda:0")
    engine.fail_next = "injected"
    with pytest.raises(RuntimeError, match="injected"):
        move("seq", 40, pool, cache, engine)
    device_sync("cuda:0")
    assert torch.equal(read_seq(pool, "seq"), kv)
    assert cache.allocator.num_free == 8


def _timed(fn: Callable[[], object]) -> float:
    """Seconds from now until `fn` and all the work it queued on cuda:0 are done."""
    device_sync("cuda:0")
    start_time = time.perf_counter()
    fn()
    device_sync("cuda:0")
    return time.perf_counter() - start_time


def test_pinned_host_to_device_copy_overlaps_compute() -> None:
    geometry = KVGeometry(
        num_layers=32, num_heads=32, head_dim=128, block_size=16, dtype=torch.float16
    )
    num_blocks = 128  # x 8 MiB = 1 GiB over the host link
    pool = KVStore("pool", geometry, num_blocks, HOST, pin_memory=True)
    cache = KVStore("decode", geometry, num_blocks, "cuda:0")
    block_ids = list(range(1, num_blocks + 1))
    engine = CopyEngine(HOST, "cuda:0")
    a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.float16)  # [8192, 8192]
    engine.copy(pool, block_ids, cache, block_ids).wait()  # warm up: pinned staging
    _timed(lambda: a @ a)  # warm up: the cuBLAS handle and workspace
    matmul_time = min(_timed(lambda: a @ a) for _ in range(3))

    handle = engine.copy(pool, block_ids, cache, block_ids)
    handle.wait()
    copy_time = handle.elapsed_time  # device time of the transfer, host gather excluded
    assert copy_time is not None
    num_matmuls = max(1, round(copy_time / matmul_time))

    def compute() -> None:
        for _ in range(num_matmuls):
            a @ a  # on the current (compute) stream

    compute_time = _timed(compute)
    device_sync("cuda:0")
    handle = engine.copy(pool, block_ids, cache, block_ids)  # returns once the DMA is queued
    start_time = time.perf_counter()
    compute()
    device_sync("cuda:0")  # waits for the copy stream too
    both_time = time.perf_counter() - start_time
    handle.wait()
    logger.warning(
        "H2D %.1f ms (%.1f GB/s), compute %.1f ms, both %.1f ms, overlap saves %.0f %%",
        copy_time * 1e3,
        num_blocks * geometry.bytes_per_block / copy_time / 1e9,
        compute_time * 1e3,
        both_time * 1e3,
        100 * (1 - both_time / (copy_time + compute_time)),
    )
    assert both_time < 0.8 * (copy_time + compute_time)
