"""`Lifecycle.transition` is the one writer of a request's status: no library code assigns
`.status` elsewhere, and in a run with evictions, returns to the pool, batch switches and
aborts, under every policy, each status change goes through it and follows the life of a
request (aserve.engine.sequence.SeqStatus)."""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from aserve.cores import Lifecycle
from aserve.engine.config import SchedulerConfig
from aserve.engine.sequence import SeqState, SeqStatus
from scheduler import POLICIES, PolicyConfig, aligned, get_policy
from sim import ClusterConfig, simulate
from tests.cores.test_differential import ABORTS, cost_model, engine_config, workload

ROOT = Path(__file__).resolve().parents[2]
S = SeqStatus
LIVE_MOVES = {  # old status -> the live statuses it may move to
    S.WAITING: {S.WAITING, S.PREFILLING},
    S.PREFILLING: {S.PREFILLING, S.WAITING, S.POOLED, S.DECODING},
    S.POOLED: {S.POOLED, S.STAGED, S.DECODING},
    S.STAGED: {S.POOLED, S.DECODING},
    S.DECODING: {S.WAITING, S.POOLED, S.STAGED},
}


def test_no_library_code_assigns_a_status_outside_lifecycle() -> None:
    writers = []
    for package in ("aserve", "sim", "bench", "scheduler"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                targets = (node.targets if isinstance(node, ast.Assign)
                           else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign)
                           else [])
                flat = [t for target in targets
                        for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
                writers += [f"{path.relative_to(ROOT)}:{t.lineno}" for t in flat
                            if isinstance(t, ast.Attribute) and t.attr == "status"
                            and not (isinstance(t.value, ast.Name) and t.value.id == "self")]
    assert writers == ["aserve/cores/lifecycle.py:" + str(_transition_line())], writers


def _transition_line() -> int:
    source = (ROOT / "aserve/cores/lifecycle.py").read_text()
    func = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.FunctionDef) and n.name == "transition")
    return next(n.lineno for n in ast.walk(func) if isinstance(n, ast.Assign))


@contextlib.contextmanager
def watched(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list, list]]:
    """Records each status change made through `Lifecycle.transition`, and each made
    around it."""
    moves: list[tuple[SeqStatus, SeqStatus]] = []
    stray: list[tuple[str, SeqStatus]] = []
    inside = [False]
    transition = Lifecycle.transition
    setattr_ = SeqState.__setattr__

    def through(self: Lifecycle, seq: SeqState, status: SeqStatus) -> None:
        moves.append((seq.status, status))
        inside[0] = True
        try:
            transition(self, seq, status)
        finally:
            inside[0] = False

    def guard(self: SeqState, name: str, value: object) -> None:
        if name == "status" and not inside[0] and hasattr(self, "status"):
            stray.append((self.seq_id, value))  # type: ignore[arg-type]
        setattr_(self, name, value)

    monkeypatch.setattr(Lifecycle, "transition", through)
    monkeypatch.setattr(SeqState, "__setattr__", guard)
    yield moves, stray


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_status_change_goes_through_transition(policy: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aligned, "HEADROOM_STEPS", 0)  # so `aligned` evicts here too
    config = engine_config(policy, starvation_threshold=0.1)
    cluster = ClusterConfig.from_engine(config, 64)
    get_policy(policy, PolicyConfig.of(SchedulerConfig(), 4096))  # the name is registered
    with watched(monkeypatch) as (moves, stray):
        result = simulate(workload(), policy, cluster, cost_model(), aborts=ABORTS)
    assert not stray
    finished = [new for old, new in moves if new.is_finished]
    assert len(finished) == len(workload().requests)  # each ends once, through transition
    assert {S.FINISHED_ABORTED, S.FINISHED_LENGTH} <= set(finished)
    live = [(old, new) for old, new in moves if not new.is_finished]
    assert all(not old.is_finished for old, _ in moves)
    illegal = {(old, new) for old, new in live if new not in LIVE_MOVES[old]}
    assert not illegal, illegal
    if policy != "continuous":
        assert (S.DECODING, S.STAGED) in live or (S.DECODING, S.POOLED) in live  # evictions
        assert any(e.kind == "evicted" for e in result.events)
