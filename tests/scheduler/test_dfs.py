"""Density-first search against a brute-force reference over plain lists, plus the cases.

The reference recomputes every subtree from the raw request list (no counters, no tree):
it is the specification of ``density_first_search`` written as directly as possible.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import QuadTree, anchored_search, density_first_search

Item = tuple[int, str, int]  # (length, request_id, num_blocks)
MAX_LEN = 256
UNLIMITED = 10**9


def reference_dfs(reqs: dict[str, tuple[int, int]], leaf_width: int, max_blocks: int,
                  min_requests: int, max_requests: int | None = None) -> list[str]:
    limit = max_requests or UNLIMITED
    width = leaf_width
    while width < MAX_LEN:
        width *= 4

    def members(lo: int, hi: int) -> list[Item]:
        return sorted((n, r, b) for r, (n, b) in reqs.items() if lo <= n < hi)

    def fits(items: list[Item]) -> bool:
        return sum(b for *_, b in items) <= max_blocks and len(items) <= limit

    if not any(b <= max_blocks for _, b in reqs.values()):
        return []
    lo, hi, parent = 0, width, None
    while not fits(items := members(lo, hi)):
        if hi - lo <= leaf_width:  # a leaf that does not fit: greedy in length order
            chosen: list[str] = []
            left = max_blocks
            for _, r, b in items:
                if b <= left and len(chosen) < limit:
                    chosen.append(r)
                    left -= b
            return chosen
        step = (hi - lo) // 4
        kids = [(lo + i * step, lo + (i + 1) * step) for i in range(4)]
        viable = [k for k in kids if any(b <= max_blocks for *_, b in members(*k))]
        parent, (lo, hi) = (lo, hi), max(viable, key=lambda k: len(members(*k)))
    chosen = [r for _, r, _ in items]
    if len(items) >= min_requests or parent is None:
        return chosen
    left_side = members(parent[0], lo)[::-1]  # nearest first = descending
    candidates = left_side or members(hi, parent[1])
    blocks_left = max_blocks - sum(b for *_, b in items)
    count = min(min_requests, limit) - len(items)
    for _, r, b in candidates:
        if count <= 0 or b > blocks_left:
            break
        chosen.append(r)
        blocks_left -= b
        count -= 1
    return chosen


Pool = st.dictionaries(st.integers(0, 60).map(lambda i: f"r{i:02d}"),
                       st.tuples(st.integers(0, MAX_LEN - 1), st.integers(0, 12)), max_size=50)


def _tree(reqs: dict[str, tuple[int, int]], leaf_width: int) -> QuadTree:
    tree = QuadTree(MAX_LEN, leaf_width)
    for r, (n, b) in reqs.items():
        tree.insert(r, n, b)
    return tree


@settings(max_examples=300, deadline=None)
@given(reqs=Pool, leaf_width=st.sampled_from([1, 4, 16]), max_blocks=st.integers(0, 120),
       min_requests=st.integers(0, 20), max_requests=st.one_of(st.none(), st.integers(1, 30)))
def test_dfs_agrees_with_reference_and_respects_limits(
        reqs: dict, leaf_width: int, max_blocks: int, min_requests: int,
        max_requests: int | None) -> None:
    tree = _tree(reqs, leaf_width)
    before = list(tree.root.requests())
    got = density_first_search(tree, max_blocks, min_requests, max_requests)
    assert got == reference_dfs(reqs, leaf_width, max_blocks, min_requests, max_requests)
    assert list(tree.root.requests()) == before, "DFS must not modify the tree"
    assert len(set(got)) == len(got)
    assert sum(reqs[r][1] for r in got) <= max_blocks
    assert max_requests is None or len(got) <= max_requests
    if any(b <= max_blocks for _, b in reqs.values()):
        assert got, "some request fits, so the batch must not be empty"
    if tree.num_blocks <= max_blocks and max_requests is None:
        assert sorted(got) == sorted(reqs), "the whole pool fits, so it is the batch"


@settings(max_examples=150, deadline=None)
@given(reqs=Pool, data=st.data(), max_blocks=st.integers(0, 120),
       min_requests=st.integers(0, 20))
def test_anchored_search_contains_anchor_and_fits(
        reqs: dict, data: st.DataObject, max_blocks: int, min_requests: int) -> None:
    if not reqs:
        return
    anchor = data.draw(st.sampled_from(sorted(reqs)))
    got = anchored_search(_tree(reqs, 4), anchor, max_blocks, min_requests)
    assert sum(reqs[r][1] for r in got) <= max_blocks
    assert (anchor in got) == (reqs[anchor][1] <= max_blocks)


def _spread_tree() -> QuadTree:
    # leaf_width 16 over [0, 256): root children cover [0,64) [64,128) [128,192) [192,256).
    tree = QuadTree(MAX_LEN, 16)
    for i in range(3):
        tree.insert(f"a{i}", 10 + i, 2)  # child 0
    for i in range(2):
        tree.insert(f"b{i}", 70 + i, 2)  # child 1
    for i in range(6):
        tree.insert(f"c{i}", 130 + i, 2)  # child 2, the densest
    tree.insert("d0", 200, 2)  # child 3
    return tree


def test_whole_tree_when_it_fits_and_is_big_enough() -> None:
    assert len(density_first_search(_spread_tree(), 24, 8)) == 12


def test_densest_subtree_when_it_fits_and_is_big_enough() -> None:
    got = density_first_search(_spread_tree(), 20, 6)
    assert got == [f"c{i}" for i in range(6)]


def test_borrows_from_left_siblings_nearest_first() -> None:
    # c-subtree has 6 < 9: borrow 3, nearest left first: b1, b0, then a2 (longest of child 0).
    assert density_first_search(_spread_tree(), 22, 9)[6:] == ["b1", "b0", "a2"]


def test_borrowing_stops_at_the_first_request_that_does_not_fit() -> None:
    # 12 blocks for c, 4 left: b1 and b0 fit, a2 would exceed the budget.
    assert density_first_search(_spread_tree(), 16, 9)[6:] == ["b1", "b0"]


def test_borrows_from_right_siblings_when_there_is_no_left_one() -> None:
    tree = QuadTree(MAX_LEN, 16)
    for i in range(5):
        tree.insert(f"a{i}", 10 + i, 2)
    tree.insert("b0", 100, 2)
    tree.insert("c0", 150, 2)
    tree.insert("d0", 250, 20)
    assert density_first_search(tree, 14, 7) == [f"a{i}" for i in range(5)] + ["b0", "c0"]


def test_descends_past_children_where_nothing_fits() -> None:
    tree = QuadTree(MAX_LEN, 16)
    for i in range(10):
        tree.insert(f"long{i}", 250, 50)
    tree.insert("short", 5, 1)
    assert density_first_search(tree, 40, 8) == ["short"]


@pytest.mark.parametrize(("max_blocks", "min_requests"), [(-1, 1), (1, -1)])
def test_bad_arguments_name_the_field(max_blocks: int, min_requests: int) -> None:
    with pytest.raises(ValueError, match="max_blocks" if max_blocks < 0 else "min_requests"):
        density_first_search(QuadTree(MAX_LEN, 16), max_blocks, min_requests)
