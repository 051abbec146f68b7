"""Density-first search (DFS) over the quad-tree, and its starvation-anchored variant.

Read-only over the tree: picks request ids, never removes them. Counts come from the node
counters, so the cost is O(depth) plus the size of the answer (and of one leaf at worst).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from scheduler.batching import take_in_order
from scheduler.quadtree import QuadNode, QuadTree


@dataclass(frozen=True, slots=True)
class _Budget:
    max_blocks: int  # KV blocks the batch may hold
    max_requests: int  # requests the batch may hold

    def fits(self, node: QuadNode) -> bool:
        return node.num_blocks <= self.max_blocks and node.num_requests <= self.max_requests


def _check_args(max_blocks: int, min_requests: int, max_requests: int | None) -> _Budget:
    if max_blocks < 0:
        raise ValueError(f"max_blocks ({max_blocks}) must be >= 0")
    if min_requests < 0:
        raise ValueError(f"min_requests ({min_requests}) must be >= 0")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests ({max_requests}) must be >= 1 or None")
    limit = max_requests if max_requests is not None else 1 << 62
    return _Budget(max_blocks, limit)


def density_first_search(tree: QuadTree, max_blocks: int, min_requests: int,
                         max_requests: int | None = None,
                         start: QuadNode | None = None) -> list[str]:
    """Choose a batch of similar-length requests (the paper's three cases).

    A subtree *fits* when its blocks are <= ``max_blocks`` and its request count is
    <= ``max_requests`` (None: no count limit). From the root:

    1. it fits and holds >= ``min_requests`` (or it is the root): take the whole subtree;
    2. it does not fit: descend into the child with the most requests, among the children
       holding at least one request that fits alone (ties: the shorter child). Restricting
       to such children is what makes the answer non-empty whenever any request fits;
    3. it fits but holds too few: take it and borrow from its siblings (``_borrow``).

    A leaf that does not fit gives a partial batch: its requests in (length, id) order,
    each taken if it still fits, skipping those that do not.

    ``start`` (a node of ``tree``; default the root) searches its subtree only, as if it
    were the root, except that case 3 may borrow from its siblings.

    Returns:
        Request ids: the chosen subtree in (length, id) order, then borrowed ones in the
        order they were borrowed. Never more than ``max_blocks`` blocks; empty only when
        the subtree is empty or no single request fits.
    """
    budget = _check_args(max_blocks, min_requests, max_requests)
    node = tree.root if start is None else start
    if node.num_requests == 0 or node.min_blocks > max_blocks:
        return []
    while not budget.fits(node):
        if node.is_leaf:
            return _fill_leaf(node, budget, node.requests())
        viable = [c for c in node.children if c.num_requests and c.min_blocks <= max_blocks]
        node = max(viable, key=lambda c: c.num_requests)  # max() keeps the first on ties
    return _take_subtree(node, budget, min_requests)


def anchored_search(tree: QuadTree, anchor_id: str, max_blocks: int, min_requests: int,
                    max_requests: int | None = None) -> list[str]:
    """DFS around one request (starvation control): the batch always contains it.

    Takes the largest subtree on the anchor's root-to-leaf path that fits, then applies
    cases 1 and 3 of ``density_first_search`` to it. If even the anchor's leaf does not
    fit, takes the anchor, then its leaf's requests nearest in length, each if it fits.

    Returns:
        Request ids with ``anchor_id`` among them, or [] when the anchor alone does not fit.
    """
    budget = _check_args(max_blocks, min_requests, max_requests)
    anchor = tree.get(anchor_id)
    if anchor.num_blocks > max_blocks:
        return []
    path = tree.path_to(anchor_id)
    for node in path:
        if budget.fits(node):
            return _take_subtree(node, budget, min_requests)
    leaf = path[-1]
    others = sorted((item for item in leaf.requests() if item[1] != anchor_id),
                    key=lambda item: (abs(item[0] - anchor.length), item[0], item[1]))
    anchored = [(anchor.length, anchor_id, anchor.num_blocks), *others]
    return _fill_leaf(leaf, budget, iter(anchored))


def _take_subtree(node: QuadNode, budget: _Budget, min_requests: int) -> list[str]:
    """Cases 1 and 3 for a subtree that fits."""
    chosen = node.request_ids()
    missing = min_requests - node.num_requests
    if missing <= 0 or node.parent is None:
        return chosen
    blocks_left = budget.max_blocks - node.num_blocks
    slots_left = budget.max_requests - node.num_requests
    return chosen + _borrow(node, blocks_left, min(missing, slots_left))


def _borrow(node: QuadNode, blocks_left: int, max_count: int) -> list[str]:
    """Case 3: borrow requests from the siblings of ``node``, nearest in length first.

    If any left sibling (shorter range) holds requests, the candidates are the requests of
    the left siblings, nearest sibling first, each sibling's in descending (length, id)
    order; otherwise those of the right siblings, nearest first, in ascending order.
    Candidates are taken one by one while their blocks fit in ``blocks_left``; the first
    that does not fit ends the borrowing, and so does reaching ``max_count``.
    """
    assert node.parent is not None, "the root has no siblings"
    siblings = node.parent.children
    left = [s for s in reversed(siblings[:node.index]) if s.num_requests]
    if left:
        candidates = (item for s in left for item in s.requests(reverse=True))
    else:
        candidates = (item for s in siblings[node.index + 1:] for item in s.requests())
    return take_in_order(((rid, blocks) for _, rid, blocks in candidates), blocks_left, max_count)


def _fill_leaf(leaf: QuadNode, budget: _Budget,
               candidates: Iterator[tuple[int, str, int]]) -> list[str]:
    """Take candidates of a leaf that does not fit whole, each while it still fits."""
    chosen: list[str] = []
    blocks_left = budget.max_blocks
    for _, request_id, num_blocks in candidates:
        if len(chosen) >= budget.max_requests or blocks_left < leaf.min_blocks:
            break
        if num_blocks <= blocks_left:
            chosen.append(request_id)
            blocks_left -= num_blocks
    return chosen
