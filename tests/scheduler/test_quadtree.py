"""QuadTree: counters and oldest-arrival stay exact under random insert/remove; errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import QuadTree
from scheduler.quadtree import NO_ARRIVAL, NO_BLOCKS

MAX_LEN = 300  # not a power of 4 times the leaf width, on purpose

Ops = st.lists(
    st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, MAX_LEN - 1),
              st.integers(0, 30), st.floats(0, 100, allow_nan=False)),
    max_size=80,
)


def _apply(tree: QuadTree, ops: list[tuple[bool, int, int, int, float]],
           model: dict[str, tuple[int, int, float]]) -> None:
    for is_insert, key, length, num_blocks, arrival in ops:
        request_id = f"r{key}"
        if is_insert and request_id not in model:
            tree.insert(request_id, length, num_blocks, arrival)
            model[request_id] = (length, num_blocks, arrival)
        elif not is_insert and request_id in model:
            tree.remove(request_id)
            del model[request_id]


@settings(max_examples=150, deadline=None)
@given(ops=Ops, leaf_width=st.sampled_from([1, 4, 7, 16]))
def test_every_node_counter_matches_its_requests(ops: list, leaf_width: int) -> None:
    tree = QuadTree(MAX_LEN, leaf_width)
    model: dict[str, tuple[int, int, float]] = {}
    _apply(tree, ops, model)
    assert len(tree) == len(model)
    assert tree.num_blocks == sum(b for _, b, _ in model.values())
    for node in tree.root.walk():
        inside = {k: v for k, v in model.items() if node.lo <= v[0] < node.hi}
        assert node.num_requests == len(inside)
        assert node.num_blocks == sum(b for _, b, _ in inside.values())
        assert node.oldest_arrival == min((a for *_, a in inside.values()), default=NO_ARRIVAL)
        assert node.min_blocks == min((b for _, b, _ in inside.values()), default=NO_BLOCKS)
        expected = sorted((v[0], k, v[1]) for k, v in inside.items())
        assert list(node.requests()) == expected
        assert list(node.requests(reverse=True)) == expected[::-1]
        if node.children:
            assert [c.hi - c.lo for c in node.children] == [(node.hi - node.lo) // 4] * 4
        else:
            assert node.is_leaf or node.num_requests == 0
        assert not node.is_leaf or node.hi - node.lo <= leaf_width


@settings(max_examples=100, deadline=None)
@given(ops=Ops, lo=st.integers(0, MAX_LEN), span=st.integers(0, MAX_LEN))
def test_range_query_and_oldest_request(ops: list, lo: int, span: int) -> None:
    tree = QuadTree(MAX_LEN, 4)
    model: dict[str, tuple[int, int, float]] = {}
    _apply(tree, ops, model)
    hi = lo + span
    expected = sorted((v[0], k, v[1]) for k, v in model.items() if lo <= v[0] <= hi)
    assert list(tree.requests_in_range(lo, hi)) == expected
    oldest = tree.oldest_request_id()
    if model:
        assert oldest is not None and model[oldest][2] == min(a for *_, a in model.values())
    else:
        assert oldest is None


@settings(max_examples=100, deadline=None)
@given(ops=Ops, lo=st.integers(0, MAX_LEN), span=st.integers(0, MAX_LEN))
def test_oldest_first_is_arrival_order_within_the_range(ops: list, lo: int, span: int) -> None:
    tree = QuadTree(MAX_LEN, 4)
    model: dict[str, tuple[int, int, float]] = {}
    _apply(tree, ops, model)
    hi = lo + span
    expected = [(k, v[1]) for v, k in sorted((v, k) for k, v in model.items()
                                              if lo <= v[0] <= hi)]
    got = list(tree.oldest_first(lo, hi))
    assert sorted(got) == sorted(expected)  # the same requests, each once
    arrivals = [model[k][2] for k, _ in got]
    assert arrivals == sorted(arrivals)  # oldest first (ties in any order)
    whole = list(tree.oldest_first())  # the whole pool: the tree's own arrival order
    assert sorted(whole) == sorted((k, v[1]) for k, v in model.items())
    assert [model[k][2] for k, _ in whole] == sorted(v[2] for v in model.values())


def test_membership_and_lookup() -> None:
    tree = QuadTree(1000, 16)
    tree.insert("a", 10, 1, arrival_time=2.0)
    assert "a" in tree and "b" not in tree
    assert tree.get("a").length == 10
    assert [n.lo for n in tree.path_to("a")][-1] <= 10 < tree.path_to("a")[-1].hi
    assert tree.remove("a").arrival_time == 2.0
    assert len(tree) == 0 and tree.num_blocks == 0


def test_insert_twice_names_the_id() -> None:
    tree = QuadTree(1000, 16)
    tree.insert("req-7", 10, 1)
    with pytest.raises(ValueError, match="req-7"):
        tree.insert("req-7", 20, 2)


def test_remove_unknown_names_the_id() -> None:
    with pytest.raises(KeyError, match="ghost"):
        QuadTree(1000, 16).remove("ghost")


@pytest.mark.parametrize("length", [-1, 1000, 5000])
def test_length_out_of_range_names_length_and_limit(length: int) -> None:
    with pytest.raises(ValueError, match=rf"length \({length}\).*'x'.*1000"):
        QuadTree(1000, 16).insert("x", length, 1)


@pytest.mark.parametrize(("max_len", "leaf_width", "field"),
                         [(0, 16, "max_len"), (100, 0, "leaf_width")])
def test_bad_geometry_names_the_field(max_len: int, leaf_width: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        QuadTree(max_len, leaf_width)
