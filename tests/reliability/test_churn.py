"""Churn soaks against `aserve serve` as an operator runs it (tests/reliability/churn.py):
no 5xx, no `error` finish, no ERROR line or traceback in the server's log, /health answering
200 within 1 s throughout, resident memory within 10 % of its warmed-up level besides the
KV blocks first written during the run (`ChurnResult.rss_growth`), event-loop lag
P99 under 50 ms (the long soaks), and every KV store empty at the end.

The short one runs in `make test` (opt-tiny, defaults); `-m soak` runs 2,000 requests over
about five minutes on opt-tiny and opt-125m, with shared KV memory on and off."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.reliability.churn import (
    ChurnResult,
    ServerProcess,
    churn_mix,
    kv_high_water,
    run_churn,
)

MAX_RSS_GROWTH = 0.10
MAX_HEALTH_S = 1.0
LAG_P99_S = 0.05  # a bucket bound of aserve_event_loop_lag_seconds


def check(result: ChurnResult, lag: bool = True) -> None:
    """Every assertion of a churn soak; `lag` adds the event loop's (a long soak's: a
    short one's few thousand heartbeats on a shared CPU are too few for a P99)."""
    print(result.summary())
    assert not [s for s in result.statuses if not isinstance(s, int) or s >= 500], result.summary()
    assert result.finishes["error"] == 0, result.summary()
    assert not result.error_lines, "\n".join(result.error_lines[:20])
    assert result.health and all(s == 200 and t < MAX_HEALTH_S for t, s in result.health), \
        [h for h in result.health if h[1] != 200 or h[0] >= MAX_HEALTH_S][:10]
    assert result.rss_growth < MAX_RSS_GROWTH, result.summary()
    assert not lag or result.lag_share_within(LAG_P99_S) >= 0.99, result.loop_lag
    assert not any(result.kv_used_end.values()), result.kv_used_end


def soak(tmp_path: Path, model: str, share: bool, num: int, rate: float, max_tokens: int,
         seed: int, concurrency: int | None = None) -> ChurnResult:
    args = ["--model", model, "--max-model-len", "4096",
            "--share-kv-memory" if share else "--no-share-kv-memory"]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        # the KV's high-water mark must be reached before the resident memory is taken:
        # a short soak runs its mix twice (the second run compared with the first), a long
        # one first sends `concurrency` long requests at once (`kv_high_water`)
        clients = churn_mix(num, rate, seed, max_tokens)
        warmup = clients if concurrency is None else (
            kv_high_water(concurrency, seed + 1, max_tokens)
            + churn_mix(num // 10, rate, seed + 2, max_tokens))
        result = asyncio.run(run_churn(server, model, clients, warmup))
    finally:
        assert server.stop() == 0
    result.log = server.log  # the whole log, shutdown included
    return result


# NOTE: opt-125m on a small CPU prefills a few hundred tokens a second, far below this
# mix's rate: its soak offers the same load and the server sheds what it cannot carry (429,
# `max_prefill_backlog`); it warms up with fewer long requests, which it could not prefill
# in minutes
SOAKS = {"opt-tiny": dict(num=2000, rate=6.5, max_tokens=512, concurrency=64),
         "opt-125m": dict(num=2000, rate=6.5, max_tokens=512, concurrency=16)}
SHORT = {"opt-tiny": dict(num=60, rate=4.0, max_tokens=512),
         "opt-125m": dict(num=60, rate=2.0, max_tokens=32)}


def test_short_churn_on_opt_tiny(tmp_path: Path) -> None:
    check(soak(tmp_path, "opt-tiny", True, seed=0, **SHORT["opt-tiny"]),  # type: ignore[arg-type]
          lag=False)


@pytest.mark.soak
@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("model", list(SHORT))
def test_short_churn(tmp_path: Path, model: str, share: bool) -> None:
    check(soak(tmp_path, model, share, seed=1, **SHORT[model]),  # type: ignore[arg-type]
          lag=False)


@pytest.mark.soak
@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("model", list(SOAKS))
def test_churn_soak(tmp_path: Path, model: str, share: bool) -> None:
    check(soak(tmp_path, model, share, seed=2, **SOAKS[model]))  # type: ignore[arg-type]
