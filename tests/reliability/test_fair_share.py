"""The per-client budget's fair share of the decode KV (aserve/entrypoints/client_budget.py):
it bites only while the engine cannot hold every client's tokens in flight, never refuses a
lone client or a client with nothing in flight, and forgets clients idle for its window."""

from __future__ import annotations

import pytest

from aserve.entrypoints.client_budget import ClientBudget
from aserve.entrypoints.protocol import RequestError

CAPACITY = 1000  # tokens the decode KV holds
WINDOW = 60.0


def refused(budget: ClientBudget, client: str, num_tokens: int, now: float) -> bool:
    try:
        budget.take(client, num_tokens, now)
    except RequestError as exc:
        assert exc.status == 429 and exc.code == "client_busy", exc
        return True
    return False


def test_a_lone_client_is_never_refused_however_much_it_queues() -> None:
    budget = ClientBudget(0, CAPACITY, WINDOW)
    assert not any(refused(budget, "a", 400, float(t)) for t in range(20))
    assert budget.num_in_flight == 8000


def test_a_heavy_client_is_held_to_its_share_once_others_are_active_and_kv_is_full() -> None:
    budget = ClientBudget(0, CAPACITY, WINDOW)
    assert not refused(budget, "light", 100, 0.0)
    budget.give_back("light", 100)  # done, but seen a moment ago: still active
    assert not refused(budget, "heavy", 600, 1.0)  # nothing in flight: always let in
    assert not refused(budget, "heavy", 300, 2.0)  # 900 of 1,000: no contention yet
    assert refused(budget, "heavy", 300, 3.0)  # 1,200 would not fit; share is 500
    assert not refused(budget, "light", 400, 4.0)  # nothing in flight: let in
    budget.give_back("heavy", 600)
    assert not refused(budget, "heavy", 100, 5.0)  # 800 in all: fits again
    assert budget.in_flight == {"heavy": 400, "light": 400}


def test_a_client_idle_for_the_window_no_longer_takes_a_share() -> None:
    budget = ClientBudget(0, CAPACITY, WINDOW)
    assert not refused(budget, "light", 10, 0.0)
    budget.give_back("light", 10)
    assert not refused(budget, "heavy", 900, 1.0)
    assert refused(budget, "heavy", 200, 2.0)  # light is active: heavy's share is 500
    assert not refused(budget, "heavy", 200, 2.0 + WINDOW)  # light is forgotten: alone
    assert "light" not in budget.last_seen


def test_a_fixed_limit_applies_without_contention_and_zero_window_turns_sharing_off() -> None:
    budget = ClientBudget(500, CAPACITY, 0.0)
    assert not refused(budget, "a", 400, 0.0)
    assert refused(budget, "a", 200, 1.0)  # past max_client_tokens, though KV has room
    assert not refused(budget, "b", 400, 1.0)
    assert not refused(budget, "b", 100, 2.0)  # 900 of 1,000 in flight; within the limit
    assert not refused(budget, "b", 0, 3.0)


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ClientBudget(0, 0, WINDOW)
