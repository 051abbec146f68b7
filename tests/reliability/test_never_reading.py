"""Clients that never read, against `aserve serve` as its own process (`-m soak`: minutes).

One client asks for a 6 x 4,000-token stream with logprobs and never reads: the server's
resident memory grows less than 100 MB, and the stream is aborted at the write timeout with
its KV freed. Then 200 such clients (from another loopback address, as one other host)
against the default configuration: /health and a normal request from this address are
still served within 1 s, since the fair share of the decode KV turns the never-reading host
away once it holds its share. Figures are printed (run with -s)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from tests.reliability.churn import ServerProcess, never_reading, scrape

pytestmark = pytest.mark.soak
WRITE_TIMEOUT = 30.0  # the default
BIG = {"model": "opt-tiny", "prompt": "never read", "max_tokens": 4000, "n": 6, "logprobs": 5,
       "ignore_eos": True, "stream": True}
MAX_RSS_GROWTH = 100 * 2**20


async def _wait_idle(session: aiohttp.ClientSession, url: str, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = await scrape(session, url)
        used = sum(v for k, v in m.items() if k.startswith("aserve_kv_blocks_used"))
        if (m["aserve_requests_running"] == 0 and m["aserve_requests_waiting"] == 0
                and used == 0) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


def test_one_never_reading_stream_costs_little_and_ends(tmp_path: Path) -> None:
    server = ServerProcess(["--model", "opt-tiny", "--max-model-len", "4096"],
                           tmp_path / "server.log")

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            await server.ready()
            port = int(server.url.rsplit(":", 1)[1])
            rss_before = server.rss()
            sock = never_reading(port, BIG)
            start, peak, aborted_at = time.monotonic(), rss_before, None
            try:
                while time.monotonic() - start < 600:
                    peak = max(peak, server.rss())
                    m = await scrape(session, server.url)
                    if m["aserve_write_timeouts_total"] >= 1:
                        aborted_at = time.monotonic() - start
                        break
                    await asyncio.sleep(0.5)
                m = await _wait_idle(session, server.url, 60)
            finally:
                sock.close()
            kv = {k: v for k, v in m.items() if k.startswith("aserve_kv_blocks_used")}
            print(f"\nnever-reading 6 x 4,000-token stream: RSS {rss_before / 2**20:.0f} MiB, "
                  f"peak {peak / 2**20:.0f} MiB (+{(peak - rss_before) / 2**20:.0f} MiB); "
                  f"aborted {aborted_at} s after sending; KV used after: {kv}")
            assert aborted_at is not None and aborted_at > WRITE_TIMEOUT
            assert peak - rss_before < MAX_RSS_GROWTH
            assert not any(kv.values())

    try:
        asyncio.run(run())
    finally:
        assert server.stop() == 0
    assert " ERROR " not in server.log and "Traceback" not in server.log


async def timed_request(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """Seconds to the first token and to the end of a streamed 32-token completion."""
    start = time.monotonic()
    first = None
    body = {"model": "opt-tiny", "prompt": "hello there", "max_tokens": 32, "ignore_eos": True,
            "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - start
    assert first is not None
    return first, time.monotonic() - start


def test_200_never_reading_clients_leave_health_and_others_served(tmp_path: Path) -> None:
    server = ServerProcess(["--model", "opt-tiny", "--max-model-len", "4096"],
                           tmp_path / "server.log")

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            await server.ready()
            port = int(server.url.rsplit(":", 1)[1])
            alone = [await timed_request(session, server.url) for _ in range(5)]
            socks = [never_reading(port, BIG, "127.0.0.2") for _ in range(200)]
            try:
                await asyncio.sleep(2.0)  # all 200 are in
                health, normal = [], []
                for _ in range(10):
                    t = time.monotonic()
                    async with session.get(f"{server.url}/health") as resp:
                        assert resp.status == 200
                    health.append(time.monotonic() - t)
                    normal.append(await timed_request(session, server.url))
                    await asyncio.sleep(1.0)
                m = await scrape(session, server.url)
            finally:
                for sock in socks:
                    sock.close()
            print(f"\n200 never-reading clients: /health {max(health) * 1000:.0f} ms at most, "
                  f"a 32-token request {max(t for _, t in normal) * 1000:.0f} ms at most, its "
                  f"first token {max(f for f, _ in normal) * 1000:.0f} ms (of 10 each; before "
                  f"they came {max(t for _, t in alone) * 1000:.0f} ms and "
                  f"{max(f for f, _ in alone) * 1000:.0f} ms); refused by the fair share: "
                  f"{m['aserve_client_budget_refusals_total']:.0f}; running "
                  f"{m['aserve_requests_running']:.0f}")
            assert max(health) < 1.0 and max(t for _, t in normal) < 1.0
            await _wait_idle(session, server.url, 120)

    try:
        asyncio.run(run())
    finally:
        assert server.stop() == 0
