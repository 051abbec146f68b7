"""Soak with disconnects (`-m soak`): 2,000 streaming requests from a mixed workload, offered
faster than the engine serves them, 40 % of the clients vanishing at random points (before the
response, right after the headers, or mid-stream). Every survivor gets all its tokens, no KV
block is left on any location, resident memory returns to within 5 % of its warmed-up level,
and the figures are printed."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from aserve.cores import LOCATIONS
from aserve.engine.config import ServerConfig
from aserve.engine.engine import Engine
from aserve.entrypoints.server import ENGINE, METRICS, create_app
from tests.aserve.conftest import MODEL, server_engine_config
from tests.aserve.test_engine import settle
from tests.reliability.conftest import rss_bytes

pytestmark = pytest.mark.soak
NUM_REQUESTS = 2000
NUM_WARMUP = NUM_REQUESTS  # the same load first: caches and allocator pools reach their size
DISCONNECT_SHARE = 0.4
ARRIVAL_RATE = 250.0  # requests/s offered: well above what opt-tiny serves on 2 CPU cores
MAX_RSS_GROWTH = 0.05  # share of the warmed-up resident memory


@dataclass(frozen=True)
class Plan:
    """One client: what it asks for, when, and where it hangs up (None: never;
    -1: before the response arrives; k: after k SSE events)."""

    prompt: list[int]
    max_tokens: int
    start_time: float  # seconds after the run starts
    cut_after: int | None
    cut_delay: float  # seconds before a client that hangs up before the response does


def workload(n: int, seed: int) -> list[Plan]:
    """Mostly short requests, some long ones (prefix lengths from 2 to ~700), Poisson
    arrivals at ARRIVAL_RATE."""
    rng = random.Random(seed)
    plans, at = [], 0.0
    for _ in range(n):
        at += rng.expovariate(ARRIVAL_RATE)
        is_long = rng.random() < 0.3
        prompt_len = rng.randint(200, 600) if is_long else rng.randint(1, 64)
        max_tokens = rng.randint(16, 96) if is_long else rng.randint(1, 32)
        cut = None
        if rng.random() < DISCONNECT_SHARE:
            cut = rng.choice([-1, rng.randint(0, max(0, max_tokens - 1))])
        plans.append(Plan([rng.randrange(4, 512) for _ in range(prompt_len)], max_tokens, at,
                          cut, rng.random() * 0.05))
    return plans


@dataclass
class Outcome:
    kind: str  # "complete", "disconnected" or "refused"
    num_tokens: int = 0
    finish_reason: str | None = None


async def _stream(session: aiohttp.ClientSession, url: str, plan: Plan) -> Outcome:
    body = {"model": MODEL, "prompt": plan.prompt, "max_tokens": plan.max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return Outcome("refused")
        outcome, num_events = Outcome("complete"), 0
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if plan.cut_after is not None and num_events >= plan.cut_after:
                resp.close()  # the client vanishes mid-stream
                return Outcome("disconnected")
            num_events += 1
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                outcome.num_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                outcome.finish_reason = choice["finish_reason"] or outcome.finish_reason
        return outcome


async def client(session: aiohttp.ClientSession, url: str, plan: Plan, t0: float) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + plan.start_time - time.perf_counter()))
    task = asyncio.ensure_future(_stream(session, url, plan))
    if plan.cut_after != -1:
        return await task
    await asyncio.sleep(plan.cut_delay)
    task.cancel()  # hangs up before (or just as) the response arrives
    try:
        return await task
    except asyncio.CancelledError:
        return Outcome("disconnected")


class Watcher:
    """Samples the engine's waiting queue and KV use while the soak runs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.peak: Counter[str] = Counter()

    async def run(self) -> None:
        while True:
            stats = self.engine.stats()
            for key in ("waiting", "running"):
                self.peak[key] = max(self.peak[key], stats[key])
            for location, (used, _) in stats["kv"].items():
                self.peak[location] = max(self.peak[location], used)
            await asyncio.sleep(0.01)


@pytest_asyncio.fixture
async def server() -> AsyncIterator[TestServer]:
    app = create_app(server_engine_config(max_prefill_tokens=2048), ServerConfig())
    async with TestServer(app, handler_cancellation=True) as srv:  # as `aserve serve`
        yield srv


async def run_clients(srv: TestServer, plans: list[Plan]) -> list[Outcome]:
    connector = aiohttp.TCPConnector(limit=0)  # every client on its own connection
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        url = str(srv.make_url("/v1/completions"))
        return await asyncio.gather(*(client(session, url, p, t0) for p in plans))


def live_rss_bytes() -> int:
    """Resident memory once the garbage is collected and glibc has handed its free heap
    pages back (NOTE: without the trim, RSS shows the allocator's high-water mark from the
    burst's peak concurrency, not memory still in use)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_bytes()


def num_aborted(server: TestServer) -> float:
    """Requests the server has counted as aborted (client gone) so far."""
    value = server.app[METRICS].registry.get_sample_value(
        "aserve_requests_finished_total", {"finish_reason": "abort"})
    return value or 0.0


def warm_caches(engine: Engine) -> None:
    """Makes every KV store resident (the host pool is zeroed lazily), so that resident
    memory afterwards measures the rest of the process only."""
    assert engine.ctx is not None
    for store in engine.ctx.kv.stores.values():
        store.tensor.fill_(0)


async def test_soak_with_disconnects_leaks_nothing(server: TestServer) -> None:
    engine = server.app[ENGINE]
    warm_caches(engine)
    await run_clients(server, workload(NUM_WARMUP, seed=1))
    await settle(engine, timeout=120)
    rss_before, start, aborted_before = live_rss_bytes(), time.perf_counter(), num_aborted(server)
    watcher = Watcher(engine)
    watch = asyncio.create_task(watcher.run())
    plans = workload(NUM_REQUESTS, seed=2)
    outcomes = await run_clients(server, plans)
    watch.cancel()
    await settle(engine, timeout=120)
    elapsed = time.perf_counter() - start
    rss_after = live_rss_bytes()
    kinds = Counter(o.kind for o in outcomes)
    stores = engine.ctx.kv.stores  # type: ignore[union-attr]
    free = {name: store.allocator.num_free for name, store in stores.items()}
    total = {name: store.allocator.num_blocks for name, store in stores.items()}
    aborted = num_aborted(server) - aborted_before
    print(f"\nsoak: {NUM_REQUESTS} requests in {elapsed:.1f} s offered at {ARRIVAL_RATE:.0f}/s; "
          f"completed {kinds['complete']}, disconnected {kinds['disconnected']} "
          f"(planned {sum(p.cut_after is not None for p in plans)}; aborted in the engine "
          f"{aborted:.0f}), refused {kinds['refused']}")
    print(f"soak: peak waiting {watcher.peak['waiting']}, peak running {watcher.peak['running']}"
          f", peak blocks used {dict((k, watcher.peak[k]) for k in LOCATIONS)}")
    print(f"soak: final free blocks {free} of {total}")
    print(f"soak: RSS {rss_before / 2**20:.1f} MiB -> {rss_after / 2**20:.1f} MiB "
          f"({(rss_after - rss_before) / rss_before:+.2%}); {len(engine.events)} lifecycle "
          f"events and {len(engine.iterations)} iteration records kept")
    for plan, outcome in zip(plans, outcomes):
        if outcome.kind == "complete":
            assert outcome.num_tokens == plan.max_tokens, (plan.max_tokens, outcome)
            assert outcome.finish_reason == "length", outcome
    assert kinds["refused"] == 0
    assert kinds["disconnected"] >= 0.3 * NUM_REQUESTS
    assert watcher.peak["waiting"] >= 50, "the offered rate should exceed capacity"
    assert free == total
    engine.check_integrity()
    assert engine.health()["healthy"]
    assert all(a.num_errors == 0 for a in engine.actors), engine.health()
    assert abs(rss_after - rss_before) <= MAX_RSS_GROWTH * rss_before
