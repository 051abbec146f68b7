"""Quad-tree index over prefix length for the host KV pool (docs/design.md §1).

Each internal node splits its length range into 4 equal sub-ranges and keeps aggregate
counters of its subtree; leaves hold the requests. Pure data structure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from sortedcontainers import SortedList

NUM_CHILDREN = 4  # fan-out of every internal node
NO_ARRIVAL = float("inf")  # oldest_arrival of an empty subtree (seconds)
NO_BLOCKS = sys.maxsize  # min_blocks of an empty subtree (blocks)


@dataclass(frozen=True, slots=True)
class PooledRequest:
    """What the tree knows about one pooled request."""

    length: int  # tokens (the tree key)
    num_blocks: int  # KV blocks the request holds
    arrival_time: float  # seconds, caller's clock


class QuadNode:
    """One length range ``[lo, hi)`` of the tree with its subtree aggregates.

    ``children`` is empty for a leaf and for an internal node that never held a request;
    otherwise it has 4 nodes covering equal sub-ranges in length order.
    """

    __slots__ = (
        "lo", "hi", "parent", "index", "children", "num_requests", "num_blocks",
        "oldest_arrival", "min_blocks", "_by_length", "_by_arrival", "_by_blocks",
    )

    def __init__(self, lo: int, hi: int, parent: QuadNode | None, index: int,
                 is_leaf: bool) -> None:
        self.lo = lo  # first length in range (tokens)
        self.hi = hi  # one past the last length in range (tokens)
        self.parent = parent
        self.index = index  # position among the parent's children (0 for the root)
        self.children: list[QuadNode] = []
        self.num_requests = 0
        self.num_blocks = 0
        self.oldest_arrival = NO_ARRIVAL  # earliest arrival_time in the subtree
        self.min_blocks = NO_BLOCKS  # smallest num_blocks of one request in the subtree
        # Leaves only: (length, request_id, num_blocks) / (arrival, id) / (blocks, id).
        self._by_length: SortedList | None = SortedList() if is_leaf else None
        self._by_arrival: SortedList | None = SortedList() if is_leaf else None
        self._by_blocks: SortedList | None = SortedList() if is_leaf else None

    @property
    def is_leaf(self) -> bool:
        return self._by_length is not None

    def __repr__(self) -> str:
        return (f"QuadNode([{self.lo}, {self.hi}), num_requests={self.num_requests}, "
                f"num_blocks={self.num_blocks})")

    def leaves(self, reverse: bool = False) -> Iterator[QuadNode]:
        """Non-empty leaves of this subtree in length order (descending if ``reverse``)."""
        stack: list[QuadNode] = [self]
        while stack:
            node = stack.pop()
            if node.num_requests == 0:
                continue
            if node.is_leaf:
                yield node
            else:
                stack.extend(node.children if reverse else reversed(node.children))

    def requests(self, reverse: bool = False) -> Iterator[tuple[int, str, int]]:
        """``(length, request_id, num_blocks)`` of the subtree in (length, id) order."""
        for leaf in self.leaves(reverse):
            items = leaf._by_length
            assert items is not None, "leaves() yields leaves only"
            yield from (reversed(items) if reverse else items)

    def request_ids(self) -> list[str]:
        """All request ids of the subtree in (length, id) order."""
        return [rid for leaf in self.leaves() for _, rid, _ in leaf._by_length or ()]

    def walk(self) -> Iterator[QuadNode]:
        """Every allocated node of the subtree, parents before children."""
        yield self
        for child in self.children:
            yield from child.walk()

    def _child_for(self, length: int) -> QuadNode:
        width = (self.hi - self.lo) // NUM_CHILDREN
        return self.children[(length - self.lo) // width]

    def _add_counts(self, num_blocks: int, arrival_time: float) -> None:
        self.num_requests += 1
        self.num_blocks += num_blocks
        self.oldest_arrival = min(self.oldest_arrival, arrival_time)
        self.min_blocks = min(self.min_blocks, num_blocks)

    def _leaf_add(self, request_id: str, info: PooledRequest) -> None:
        assert self._by_length is not None and self._by_arrival is not None
        assert self._by_blocks is not None
        self._by_length.add((info.length, request_id, info.num_blocks))
        self._by_arrival.add((info.arrival_time, request_id))
        self._by_blocks.add((info.num_blocks, request_id))

    def _leaf_drop(self, request_id: str, info: PooledRequest) -> None:
        assert self._by_length is not None and self._by_arrival is not None
        assert self._by_blocks is not None
        self._by_length.remove((info.length, request_id, info.num_blocks))
        self._by_arrival.remove((info.arrival_time, request_id))
        self._by_blocks.remove((info.num_blocks, request_id))
        self.num_requests -= 1
        self.num_blocks -= info.num_blocks
        self.oldest_arrival = self._by_arrival[0][0] if self._by_arrival else NO_ARRIVAL
        self.min_blocks = self._by_blocks[0][0] if self._by_blocks else NO_BLOCKS

    def _inner_drop(self, info: PooledRequest) -> None:
        self.num_requests -= 1
        self.num_blocks -= info.num_blocks
        # NOTE: only a removed extreme forces a rescan, and then of 4 children, not leaves.
        if info.arrival_time <= self.oldest_arrival:
            self.oldest_arrival = min(c.oldest_arrival for c in self.children)
        if info.num_blocks <= self.min_blocks:
            self.min_blocks = min(c.min_blocks for c in self.children)


class QuadTree:
    """Index of pooled requests by length; insert and remove cost O(depth).

    The root covers ``[0, leaf_width * 4**depth)``, the smallest such range that holds
    ``[0, max_len)``, so every split is exact; lengths are validated against ``max_len``.
    """

    def __init__(self, max_len: int, leaf_width: int) -> None:
        if max_len < 1:
            raise ValueError(f"max_len ({max_len}) must be >= 1")
        if leaf_width < 1:
            raise ValueError(f"leaf_width ({leaf_width}) must be >= 1")
        self.max_len = max_len
        self.leaf_width = leaf_width
        width = leaf_width
        while width < max_len:
            width *= NUM_CHILDREN
        self.root = QuadNode(0, width, None, 0, is_leaf=width <= leaf_width)
        self._entries: dict[str, tuple[PooledRequest, QuadNode]] = {}
        self._by_arrival = SortedList()  # (arrival_time, request_id) of every request

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    @property
    def num_blocks(self) -> int:
        return self.root.num_blocks

    @property
    def oldest_arrival(self) -> float:
        """Earliest arrival_time in the tree (``inf`` when empty)."""
        return self.root.oldest_arrival

    def insert(self, request_id: str, length: int, num_blocks: int,
               arrival_time: float = 0.0) -> None:
        """Add a request. Raises ValueError on a duplicate id or an out-of-range value."""
        if request_id in self._entries:
            raise ValueError(f"request_id {request_id!r} is already in the quad-tree")
        if not 0 <= length < self.max_len:
            raise ValueError(
                f"length ({length}) of request {request_id!r} must be in [0, {self.max_len})")
        if num_blocks < 0:
            raise ValueError(f"num_blocks ({num_blocks}) of request {request_id!r} must be >= 0")
        info = PooledRequest(length, num_blocks, arrival_time)
        node = self.root
        while True:
            node._add_counts(num_blocks, arrival_time)
            if node.is_leaf:
                break
            if not node.children:
                self._split(node)
            node = node._child_for(length)
        node._leaf_add(request_id, info)
        self._entries[request_id] = (info, node)
        self._by_arrival.add((arrival_time, request_id))

    def remove(self, request_id: str) -> PooledRequest:
        """Remove a request and return what the tree knew. Raises KeyError if unknown."""
        found = self._entries.pop(request_id, None)
        if found is None:
            raise KeyError(f"request_id {request_id!r} is not in the quad-tree")
        info, leaf = found
        leaf._leaf_drop(request_id, info)
        self._by_arrival.remove((info.arrival_time, request_id))
        node = leaf.parent
        while node is not None:
            node._inner_drop(info)
            node = node.parent
        return info

    def get(self, request_id: str) -> PooledRequest:
        """What the tree knows of a request. Raises KeyError if unknown."""
        found = self._entries.get(request_id)
        if found is None:
            raise KeyError(f"request_id {request_id!r} is not in the quad-tree")
        return found[0]

    def lengths(self, request_ids: Iterable[str]) -> list[int]:
        """The lengths of ``request_ids``, in order (one lookup each: a cost-aware policy
        costs candidate batches of ~100-250 ids per decision). Raises KeyError if one is
        unknown."""
        entries = self._entries
        return [entries[request_id][0].length for request_id in request_ids]

    def path_to(self, request_id: str) -> list[QuadNode]:
        """Nodes from the root down to the leaf holding ``request_id``."""
        leaf = self._entries[request_id][1]
        path: list[QuadNode] = []
        node: QuadNode | None = leaf
        while node is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    def oldest_request_id(self) -> str | None:
        """Id of the request with the earliest arrival_time (ties: by position), O(depth)."""
        node = self.root
        if node.num_requests == 0:
            return None
        while not node.is_leaf:
            node = next(c for c in node.children if c.oldest_arrival == node.oldest_arrival)
        assert node._by_arrival is not None
        return str(node._by_arrival[0][1])

    def requests_in_range(self, lo: int, hi: int) -> Iterator[tuple[int, str, int]]:
        """``(length, request_id, num_blocks)`` with ``lo <= length <= hi``, in length order."""
        stack: list[QuadNode] = [self.root]
        while stack:
            node = stack.pop()
            if node.num_requests == 0 or node.hi <= lo or node.lo > hi:
                continue
            if not node.is_leaf:
                stack.extend(reversed(node.children))
                continue
            assert node._by_length is not None
            for item in node._by_length.irange((lo,), (hi + 1,), inclusive=(True, False)):
                yield item

    def oldest_first(self, lo: int = 0, hi: int | None = None) -> Iterator[tuple[str, int]]:
        """``(request_id, num_blocks)`` with ``lo <= length <= hi`` (any length by default),
        earliest arrival_time first; lazy: the tree's own arrival order for the whole pool
        (taking k requests costs O(k)), else a merge of the leaves' arrival orders, so
        taking k costs O(leaves + k log leaves), not a pass over the pool."""
        entries = self._entries
        if lo <= 0 and hi is None:  # the whole pool: one sorted list, no merge of the leaves
            for _, request_id in self._by_arrival:
                yield request_id, entries[request_id][0].num_blocks
            return
        top = self.max_len if hi is None else hi
        leaves = [leaf._by_arrival for leaf in self.root.leaves()
                  if leaf._by_arrival and leaf.hi > lo and leaf.lo <= top]
        for _, request_id in heapq.merge(*leaves):
            info = entries[request_id][0]
            if lo <= info.length <= top:
                yield request_id, info.num_blocks

    def _split(self, node: QuadNode) -> None:
        width = (node.hi - node.lo) // NUM_CHILDREN
        is_leaf = width <= self.leaf_width
        node.children = [
            QuadNode(node.lo + i * width, node.lo + (i + 1) * width, node, i, is_leaf)
            for i in range(NUM_CHILDREN)
        ]
