"""CopyEngine and move on the CPU: exact bytes, src freed exactly once, failures lose nothing."""

from __future__ import annotations

import pytest
import torch

from tests.transport.helpers import fill_seq, make_store, read_seq
from transport.copy import CopyEngine, block_runs, device_sync, move
from transport.kv import KVGeometry, KVStore

CPU = torch.device("cpu")


@pytest.fixture
def engine() -> CopyEngine:
    return CopyEngine(CPU, CPU)


@pytest.mark.parametrize("num_tokens", [1, 4, 13])
def test_move_preserves_the_exact_kv_bytes(
    geometry: KVGeometry, engine: CopyEngine, num_tokens: int
) -> None:
    src = make_store("pool", geometry, 8)
    dst = make_store("decode", geometry, 8)
    src.allocator.allocate("other", 5)  # so the request's ids differ between the stores
    kv = fill_seq(src, "seq", num_tokens, seed=1)
    src_ids = src.allocator.table("seq")
    handle = move("seq", num_tokens, src, dst, engine)
    assert handle is not None
    handle.wait()
    assert dst.allocator.table("seq") != src_ids
    assert torch.equal(read_seq(dst, "seq"), kv)
    assert handle.nbytes == kv.numel() * kv.element_size()
    assert handle.elapsed_time is not None and handle.elapsed_time >= 0
    src.allocator.check_integrity()
    dst.allocator.check_integrity()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("same_store", [False, True])
def test_copy_of_scattered_blocks_writes_exactly_the_named_rows(
    geometry: KVGeometry, engine: CopyEngine, seed: int, same_store: bool
) -> None:
    """Ids in runs, alone, descending and interleaved (a fragmented store), between two
    stores or within one (a fork): each dst row gets its src row, every other row keeps
    its bytes."""
    src = make_store("pool", geometry, 24)
    dst = src if same_store else make_store("decode", geometry, 24)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(24, generator=generator).add(1).tolist()
    if seed % 2:  # runs consecutive in both stores, split where either breaks
        order = sorted(order[:12]) + order[12:]
    num_moved = 4 + seed
    src_ids, dst_ids = order[:num_moved], order[num_moved:2 * num_moved]
    src_before, dst_before = src.tensor.clone(), dst.tensor.clone()
    engine.copy(src, src_ids, dst, dst_ids).wait()
    expected = dst_before.clone()
    expected[dst_ids] = src_before[src_ids]
    assert torch.equal(dst.tensor, expected)
    if not same_store:
        assert torch.equal(src.tensor, src_before)


def test_block_runs_join_ids_consecutive_in_both_lists() -> None:
    assert block_runs([3, 4, 5, 9, 10, 2], [7, 8, 1, 2, 3, 4]) == [
        (3, 7, 2), (5, 1, 1), (9, 2, 2), (2, 4, 1)]
    assert block_runs([], []) == []


def test_move_frees_src_exactly_once(geometry: KVGeometry, engine: CopyEngine) -> None:
    src = make_store("pool", geometry, 8)
    dst = make_store("decode", geometry, 8)
    fill_seq(src, "seq", 9, seed=2)
    handle = move("seq", 9, src, dst, engine)
    assert handle is not None
    assert "seq" in src.allocator  # freed only once completion is observed
    assert handle.done()
    assert "seq" not in src.allocator and src.allocator.num_free == 8
    handle.wait()  # observing completion again frees nothing twice (a double free would raise)
    assert handle.done()
    assert src.allocator.num_free == 8 and dst.allocator.num_used == 3
    src.allocator.check_integrity()


def test_failing_copy_leaves_src_intact_and_dst_unchanged(
    geometry: KVGeometry, engine: CopyEngine
) -> None:
    src = make_store("pool", geometry, 8)
    dst = make_store("decode", geometry, 8)
    kv = fill_seq(src, "seq", 10, seed=3)
    dst_before = dst.tensor.clone()
    engine.fail_next = "injected copy fault"
    with pytest.raises(RuntimeError, match="injected copy fault"):
        move("seq", 10, src, dst, engine)
    assert torch.equal(read_seq(src, "seq"), kv)
    assert dst.allocator.num_free == 8 and "seq" not in dst.allocator
    assert torch.equal(dst.tensor, dst_before)
    assert engine.fail_next is None  # the hook fires once
    handle = move("seq", 10, src, dst, engine)  # and the request can still move
    assert handle is not None
    handle.wait()
    assert torch.equal(read_seq(dst, "seq"), kv)
    src.allocator.check_integrity()
    dst.allocator.check_integrity()


def test_move_into_a_full_store_returns_none_and_changes_nothing(
    geometry: KVGeometry, engine: CopyEngine
) -> None:
    src = make_store("pool", geometry, 8)
    dst = make_store("decode", geometry, 2)
    kv = fill_seq(src, "seq", 12, seed=4)
    dst_before = dst.tensor.clone()
    assert move("seq", 12, src, dst, engine) is None
    assert torch.equal(read_seq(src, "seq"), kv)
    assert dst.allocator.num_free == 2 and torch.equal(dst.tensor, dst_before)


def test_move_copies_only_the_blocks_of_num_tokens(
    geometry: KVGeometry, engine: CopyEngine
) -> None:
    src = make_store("pool", geometry, 8)
    dst = make_store("decode", geometry, 8)
    kv = fill_seq(src, "seq", 16, seed=5)  # 4 blocks reserved, 6 tokens valid
    handle = move("seq", 6, src, dst, engine)
    assert handle is not None
    handle.wait()
    assert torch.equal(read_seq(dst, "seq"), kv[:2])
    assert src.allocator.num_free == 8


def test_move_of_more_tokens_than_src_holds_raises(
    geometry: KVGeometry, engine: CopyEngine
) -> None:
    src = make_store("pool", geometry, 8)
    dst = make_store("decode", geometry, 8)
    fill_seq(src, "seq", 4, seed=6)
    with pytest.raises(ValueError, match="num_tokens"):
        move("seq", 5, src, dst, engine)
    assert dst.allocator.num_free == 8


def test_copy_between_different_geometries_raises(geometry: KVGeometry, engine: CopyEngine) -> None:
    other = KVGeometry(num_layers=1, num_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    src = KVStore("pool", geometry, 4, CPU)
    dst = KVStore("decode", other, 4, CPU)
    with pytest.raises(ValueError, match="geometry"):
        engine.copy(src, [1], dst, [1])


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "match"),
    [
        ([1, 2], [1], "len"),
        ([1], [0], "dst_ids"),
        ([5], [1], "src_ids"),
        ([1, 2], [3, 3], "repeat"),
    ],
)
def test_copy_rejects_bad_block_ids(
    geometry: KVGeometry, engine: CopyEngine, src_ids: list[int], dst_ids: list[int], match: str
) -> None:
    src = KVStore("pool", geometry, 4, CPU)
    dst = KVStore("decode", geometry, 4, CPU)
    with pytest.raises(ValueError, match=match):
        engine.copy(src, src_ids, dst, dst_ids)
    assert bool((dst.tensor[0] == 0).all())


def test_copy_writes_rows_in_the_given_order(geometry: KVGeometry, engine: CopyEngine) -> None:
    src = make_store("pool", geometry, 6)
    dst = make_store("decode", geometry, 6)
    expected = src.tensor[[5, 1, 3]].clone()
    engine.copy(src, [5, 1, 3], dst, [2, 6, 4]).wait()
    assert torch.equal(dst.tensor[[2, 6, 4]], expected)
    assert torch.equal(dst.tensor[1], make_store("x", geometry, 6).tensor[1])  # untouched row


def test_device_sync_on_cpu_returns() -> None:
    device_sync(CPU)
