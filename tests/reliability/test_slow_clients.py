"""Slow and idle clients on real loopback sockets: a head or a body dribbled a byte at a time,
a Content-Length the body never reaches, a connection that sends nothing, and more
connections than the cap. Each is cut off by its configured limit while /health keeps
answering; past the cap a new connection gets a fast 503 and service resumes once clients
leave. Latencies are printed (run with -s), not asserted: the machine is shared."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator

import aiohttp
import pytest

from aserve.engine.config import ServerConfig
from aserve.entrypoints.guard import PROBE_SLOTS
from tests.aserve.conftest import server_engine_config
from tests.reliability.conftest import GuardedLiveServer, raw_exchange

HEADER_TIMEOUT = 1.0  # seconds
BODY_TIMEOUT = 1.0  # seconds
KEEPALIVE_TIMEOUT = 8.0  # seconds; longer than CUT_OFF_BOUND heads: aiohttp's keep-alive
# timer (which also runs before a first request) cannot pass for the head deadline
MAX_CONNECTIONS = 8
DRIP_S = 0.25  # seconds between the bytes a slow client sends
CUT_OFF_BOUND = 6.0  # a slow client is cut off within this many times its timeout (generous)


@pytest.fixture(scope="module")
def server() -> Iterator[GuardedLiveServer]:
    srv = GuardedLiveServer(server_engine_config(), ServerConfig(
        port=0, header_timeout=HEADER_TIMEOUT, body_timeout=BODY_TIMEOUT,
        keepalive_timeout=KEEPALIVE_TIMEOUT, max_connections=MAX_CONNECTIONS))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _drip(data: bytes) -> list[bytes]:
    return [data[i:i + 1] for i in range(len(data))]


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
BODY = b'{"model": "opt-tiny", "prompt": "hello", "max_tokens": 2}'
SLOW_CLIENTS = {
    # name: (chunks, the limit that must cut it off, status of the answer or None for none)
    "slow_head": (_drip(HEAD + b"X-Padding: " + b"a" * 200), HEADER_TIMEOUT, None),
    "slow_body": ([HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY), *_drip(BODY)],
                  BODY_TIMEOUT, 408),
    "short_body": ([HEAD + b"Content-Length: %d\r\n\r\n" % (len(BODY) + 10), BODY],
                   BODY_TIMEOUT, 408),
    "silent": ([], HEADER_TIMEOUT, None),
}


async def _poll_health(url: str, stop: asyncio.Event) -> list[tuple[int, float]]:
    """(status, seconds) of a /health request every 50 ms until `stop`, each on a new
    connection."""
    answers = []
    while not stop.is_set():
        start = time.perf_counter()
        async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as resp:
            answers.append((resp.status, time.perf_counter() - start))
        await asyncio.sleep(0.05)
    return answers


@pytest.mark.parametrize("name", sorted(SLOW_CLIENTS))
async def test_slow_client_is_cut_off_while_health_answers(server: GuardedLiveServer,
                                                           name: str) -> None:
    chunks, limit, status = SLOW_CLIENTS[name]
    stop = asyncio.Event()
    health = asyncio.create_task(_poll_health(server.url, stop))
    clients = [raw_exchange(server.port, chunks, DRIP_S) for _ in range(4)]
    results = await asyncio.gather(*clients)
    stop.set()
    answers = await health
    for received, seconds in results:
        assert seconds < CUT_OFF_BOUND * limit, (name, seconds, received[:200])
        if status is None:
            assert received == b"", received[:200]
        else:
            assert received.startswith(b"HTTP/1.1 %d" % status), received[:200]
    assert answers and all(s == 200 for s, _ in answers), answers
    latencies = sorted(t for _, t in answers)
    print(f"\n{name}: cut off after {[round(s, 2) for _, s in results]} s (limit {limit} s); "
          f"/health x{len(answers)} median {statistics.median(latencies) * 1e3:.1f} ms, "
          f"max {latencies[-1] * 1e3:.1f} ms")


async def test_the_connection_cap_gives_a_fast_503_then_recovers(
        server: GuardedLiveServer) -> None:
    # the cap and the probe slots past it (/health takes those) are all held
    open_ = [await asyncio.open_connection("127.0.0.1", server.port)
             for _ in range(MAX_CONNECTIONS + PROBE_SLOTS)]
    await asyncio.sleep(0.1)  # the server has registered them all
    try:
        async with aiohttp.ClientSession() as session:
            start = time.perf_counter()
            async with session.get(f"{server.url}/health") as resp:
                refused = time.perf_counter() - start
                body = await resp.json()
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                assert body["error"]["code"] == "too_many_connections"
                assert str(MAX_CONNECTIONS) in body["error"]["message"]
    finally:
        for _, writer in open_:
            writer.close()
    start = time.perf_counter()
    while True:  # the server sees the closes within a few loop turns
        async with aiohttp.ClientSession() as session, \
                session.get(f"{server.url}/health") as resp:
            if resp.status == 200:
                break
        assert time.perf_counter() - start < 30, "never recovered after the clients left"
        await asyncio.sleep(0.02)
    print(f"\ncap: 503 after {refused * 1e3:.1f} ms; 200 again "
          f"{(time.perf_counter() - start) * 1e3:.0f} ms after the clients left")


async def test_idle_keepalive_connection_is_closed(server: GuardedLiveServer) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    received, seconds = await raw_exchange(server.port, [request])
    assert received.startswith(b"HTTP/1.1 200"), received[:200]
    assert seconds < CUT_OFF_BOUND * KEEPALIVE_TIMEOUT
    print(f"\nkeep-alive: idle connection closed after {seconds:.2f} s "
          f"(keepalive_timeout {KEEPALIVE_TIMEOUT} s)")
