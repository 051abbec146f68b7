"""Property test of the KV ledger and the copy path together: random admissions, forks
(n > 1), moves between stores, evictions to the host pool, aborts (mid-move too) and growth,
with the stores of one device sharing one KV tensor and with a tensor each. Every move of a
valid sequence succeeds and carries its exact KV, and every block is freed exactly once."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from aserve.cores import BlockLedger, Move, kv_stores
from aserve.engine.config import CacheConfig
from aserve.engine.sequence import Request, SamplingParams, SeqState
from transport.copy import CopyEngine
from transport.kv import KVGeometry, stores_for

GEOMETRY = KVGeometry(num_layers=1, num_heads=1, head_dim=2, block_size=4, dtype=torch.float32)
# small quotas, so that a shared pool's ids soon run past any one store's quota
CACHE = dict(block_size=4, num_decode_blocks=12, num_prefill_blocks=8, num_staging_blocks=6)
HOST_BLOCKS = 10
NEXT_STORE = {"prefill0": "host", "host": "staging0", "staging0": "decode0", "decode0": "host"}


class LedgerMoves(RuleBasedStateMachine):
    """One engine's stores (a prefill scratch, a staging buffer, the host pool, a decode
    cache, as `kv_stores` lays them out on one CPU) driven through `BlockLedger` and
    `CopyEngine` as the driver drives them (`KVSpace.copy`)."""

    share_memory = True
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        layout = kv_stores(("cpu",), ("cpu",), CacheConfig(**CACHE), HOST_BLOCKS)
        self.ledger = BlockLedger(layout, GEOMETRY.block_size, self.share_memory)
        self.stores = stores_for(layout, self.ledger.allocators, GEOMETRY)
        self.engine = CopyEngine("cpu", "cpu")
        self.kv: dict[str, torch.Tensor] = {}  # seq_id -> the KV rows it must hold
        self.live: dict[str, SeqState] = {}
        self.allocs: Counter[str] = Counter()  # tables given to an owner, over all stores
        self.frees: Counter[str] = Counter()  # tables an owner gave back
        self.num_seqs = 0

    # -- helpers ---------------------------------------------------------------------------
    def _new_seq(self, num_tokens: int) -> SeqState:
        self.num_seqs += 1
        request = Request(request_id=f"s{self.num_seqs}", prompt_token_ids=(1,) * num_tokens,
                          sampling=SamplingParams(max_tokens=1), arrival_time=0.0)
        seq = SeqState.from_request(request)
        seq.num_computed_tokens = num_tokens
        return seq

    def _rows(self, seq: SeqState) -> torch.Tensor:
        return self.stores[seq.location].tensor[self.ledger.table(seq)].clone()

    def _carry_out(self, move: Move) -> None:
        """What `KVSpace.copy` does: a hand-over commits at once, a copy copies first."""
        if not move.handover:
            src_ids, dst_ids = self.ledger.tables(move)
            self.engine.copy(self.stores[move.src], src_ids, self.stores[move.dst],
                             dst_ids).wait()
        was_fork = move.src_ids is not None
        self.ledger.commit(move, 0.0, 0.0)
        if not was_fork:
            self.frees[move.seq.seq_id] += 1  # its source table went back
        self.allocs[move.seq.seq_id] += 1

    def _release(self, seq: SeqState) -> None:
        self.ledger.release(seq)
        self.frees[seq.seq_id] += 1
        del self.live[seq.seq_id], self.kv[seq.seq_id]

    # -- rules ----------------------------------------------------------------------------
    @rule(target=seqs, num_tokens=st.integers(1, 20), seed=st.integers(0, 2**16))
    def admit(self, num_tokens: int, seed: int) -> SeqState:
        seq = self._new_seq(num_tokens)
        if not self.ledger.allocate(seq, "prefill0", num_tokens):
            return seq  # full: the request waits (it holds nothing)
        self.allocs[seq.seq_id] += 1
        ids = self.ledger.table(seq)
        rows = torch.randn((len(ids), *GEOMETRY.block_shape),
                           generator=torch.Generator().manual_seed(seed))
        self.stores["prefill0"].tensor[ids] = rows
        self.live[seq.seq_id], self.kv[seq.seq_id] = seq, rows
        return seq

    @rule(target=seqs, parent=seqs)
    def fork(self, parent: SeqState) -> SeqState:
        """A sample of `parent`'s prompt gets a copy of its KV in the parent's store."""
        child = self._new_seq(parent.num_computed_tokens)
        if parent.seq_id not in self.live:
            return child
        move = self.ledger.reserve(child, parent.location, parent)
        if move is None:
            return child  # the store is full: the sample waits
        self._carry_out(move)
        self.live[child.seq_id], self.kv[child.seq_id] = child, self.kv[parent.seq_id].clone()
        return child

    @rule(seq=seqs)
    def move(self, seq: SeqState) -> None:
        """Offload, stage, admit to decode, or evict from decode to the host pool."""
        if seq.seq_id in self.live:
            move = self.ledger.reserve(seq, NEXT_STORE[seq.location])
            if move is not None:
                self._carry_out(move)

    @rule(seq=seqs, num_more=st.integers(1, 12))
    def grow(self, seq: SeqState, num_more: int) -> None:
        """Decode appends tokens: the table grows (its old rows keep their KV)."""
        if seq.seq_id in self.live:
            self.ledger.grow(seq, seq.num_computed_tokens + num_more)

    @rule(seq=consumes(seqs))
    def abort(self, seq: SeqState) -> None:
        if seq.seq_id in self.live:
            self._release(seq)

    @rule(seq=consumes(seqs))
    def abort_mid_move(self, seq: SeqState) -> None:
        """A move reserved, then called off (the seq ended or the copy failed) before it
        landed; the seq then ends."""
        if seq.seq_id not in self.live:
            return
        move = self.ledger.reserve(seq, NEXT_STORE[seq.location])
        if move is not None:
            self.ledger.cancel(move)
        self._release(seq)

    # -- what holds throughout ------------------------------------------------------------
    @invariant()
    def every_live_seq_holds_its_kv(self) -> None:
        for seq_id, seq in self.live.items():
            rows = self._rows(seq)[: len(self.kv[seq_id])]
            assert torch.equal(rows, self.kv[seq_id]), f"{seq_id} in {seq.location}"

    @invariant()
    def tables_add_up(self) -> None:
        for allocator in self.ledger.allocators.values():
            allocator.check_integrity()

    @rule()
    def drain(self) -> None:
        """Everything ends: every store is empty, every table was freed exactly once."""
        for seq in list(self.live.values()):
            self._release(seq)
        for allocator in self.ledger.allocators.values():
            assert allocator.num_used == 0 and not allocator.owners, allocator
            assert len(allocator.pool.free_ids) == allocator.pool.num_blocks
        assert self.allocs == self.frees, {k: (self.allocs[k], self.frees[k])
                                           for k in self.allocs | self.frees
                                           if self.allocs[k] != self.frees[k]}


class LedgerMovesUnshared(LedgerMoves):
    share_memory = False


PROFILE = settings(max_examples=60, stateful_step_count=40, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow])
TestSharedMemory = LedgerMoves.TestCase
TestSharedMemory.settings = PROFILE
TestUnsharedMemory = LedgerMovesUnshared.TestCase
TestUnsharedMemory.settings = PROFILE
