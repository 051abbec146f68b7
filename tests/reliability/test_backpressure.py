"""Clients that stop reading, clients that leave, an engine that fails, and a loop that is
held: a stream nobody reads is aborted at the write timeout with its KV freed; probes get a
slot past the connection cap; one client's tokens in flight are capped; a client leaving is
an INFO line, never a 500; an actor's error turns /health unhealthy until a step goes through,
and is counted by kind; a held event loop is logged with what held it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from aserve.engine.config import ServerConfig
from aserve.entrypoints.loop_watch import LoopWatch
from aserve.entrypoints.server import ENGINE, create_app
from tests.aserve.conftest import parse_metrics, server_engine_config
from tests.aserve.test_engine import settle
from tests.reliability.churn import never_reading, request_bytes
from tests.reliability.conftest import GuardedLiveServer, wait_for_event

WRITE_TIMEOUT = 1.0  # seconds
MAX_CONNECTIONS = 2


@pytest.fixture(scope="module")
def server() -> Iterator[GuardedLiveServer]:
    srv = GuardedLiveServer(server_engine_config(max_position_embeddings=4096), ServerConfig(
        port=0, write_timeout=WRITE_TIMEOUT, max_connections=MAX_CONNECTIONS))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


async def metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as resp:
        return parse_metrics(await resp.text())


BIG_STREAM = {"model": "opt-tiny", "prompt": "never read", "max_tokens": 4000, "n": 6,
              "logprobs": 5, "ignore_eos": True, "stream": True}


async def test_stream_nobody_reads_is_aborted_at_the_write_timeout(
        server: GuardedLiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "aserve.entrypoints.server")
    before = await metrics(server.url)
    sock = await asyncio.to_thread(never_reading, server.port, BIG_STREAM)
    try:
        deadline = time.monotonic() + 120
        while (await metrics(server.url))["aserve_write_timeouts_total"] == \
                before["aserve_write_timeouts_total"]:
            assert time.monotonic() < deadline, "the stream was never aborted"
            await asyncio.sleep(0.2)
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            settle(server.engine, timeout=30), server.loop))  # every KV block is free
    finally:
        sock.close()
    assert any("write_timeout" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    after = await metrics(server.url)
    assert after['aserve_requests_finished_total{finish_reason="abort"}'] >= \
        before['aserve_requests_finished_total{finish_reason="abort"}'] + 6


async def test_probes_have_a_slot_past_the_connection_cap(server: GuardedLiveServer) -> None:
    socks = [await asyncio.to_thread(never_reading, server.port, BIG_STREAM)
             for _ in range(MAX_CONNECTIONS)]
    try:
        await asyncio.sleep(0.5)  # both connections are open and streaming
        async with aiohttp.ClientSession() as s:
            start = time.monotonic()
            async with s.get(f"{server.url}/health") as resp:
                assert resp.status == 200
            async with s.get(f"{server.url}/metrics") as resp:
                assert resp.status == 200
            assert time.monotonic() - start < 5
        async with aiohttp.ClientSession() as s, s.get(f"{server.url}/v1/models") as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "too_many_connections"
    finally:
        for sock in socks:
            sock.close()
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
        settle(server.engine, timeout=30), server.loop))


async def test_one_client_cannot_hold_more_than_its_tokens() -> None:
    app = create_app(server_engine_config(max_position_embeddings=4096),
                     ServerConfig(max_client_tokens=30_000))
    body = {"model": "opt-tiny", "prompt": "x" * 50, "max_tokens": 2000, "n": 6,
            "ignore_eos": True, "stream": True}  # 6 x 2,050 tokens: 2 fit in the budget
    async with TestClient(TestServer(app)) as client:
        held = [await client.post("/v1/completions", json=body) for _ in range(2)]
        try:
            assert [r.status for r in held] == [200, 200]
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["code"] == "client_busy"
        finally:
            for r in held:
                r.close()
        await settle(app[ENGINE], timeout=30)
        small = {"model": "opt-tiny", "prompt": "hello", "max_tokens": 4}
        resp = await client.post("/v1/completions", json=small)
        assert resp.status == 200  # the budget was given back


async def test_a_client_leaving_is_info_not_a_500(
        server: GuardedLiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    for cut in (20, None):  # mid-body, then right after the whole request
        data = request_bytes({"model": "opt-tiny", "prompt": "bye", "max_tokens": 200,
                              "ignore_eos": True})
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(data[:-cut] if cut else data)
        await writer.drain()
        writer.transport.abort()  # a reset, as a client killed mid-request
    await asyncio.sleep(1.0)
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
        settle(server.engine, timeout=30), server.loop))
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not [r for r in caplog.records if r.name == "aiohttp.access" and " 500 " in
                r.getMessage()]


async def test_an_actor_error_is_unhealthy_until_a_step_goes_through() -> None:
    app = create_app(server_engine_config(), ServerConfig(health_details=True))
    async with TestClient(TestServer(app)) as client:
        engine = client.server.app[ENGINE]
        runner = next(iter(engine.ctx.runners.values()))

        def fail_once() -> None:
            runner.fault_hook = None
            raise RuntimeError("injected step failure")

        runner.fault_hook = fail_once
        body = {"model": "opt-tiny", "prompt": "hello", "max_tokens": 4}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 500
        health = await client.get("/health")
        report = await health.json()
        assert health.status == 503 and report["actors"]["prefill0"]["failing"] is True
        m = parse_metrics(await (await client.get("/metrics")).text())
        assert m['aserve_engine_errors_total{actor="prefill0",kind="RuntimeError"}'] == 1
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
        assert (await client.get("/health")).status == 200  # the next step went through


async def test_a_held_event_loop_is_logged_with_what_held_it(
        caplog: pytest.LogCaptureFixture) -> None:
    lags: list[float] = []
    watch = LoopWatch(lags.append, threshold=0.1, beat=0.01)
    watch.start()
    await asyncio.sleep(0.05)

    def hold_the_loop() -> None:
        time.sleep(0.4)

    hold_the_loop()
    await asyncio.sleep(0.05)
    await watch.stop()
    assert max(lags) > 0.3 and watch.num_stalls == 1
    [record] = [r for r in caplog.records if r.name == "aserve.entrypoints.loop_watch"]
    assert record.levelno == logging.WARNING and "hold_the_loop" in record.getMessage()


async def test_steps_a_consumer_did_not_take_come_as_one_output() -> None:
    """The engine's side of back-pressure: outputs are coalesced while nobody takes them."""
    from aserve import Engine, SamplingParams
    from tests.conftest import make_config

    async with Engine(make_config()) as engine:
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True),
                                 "lagging")
        first = await stream.__anext__()
        await wait_for_event(engine, "lagging", "finish")  # every step ran meanwhile
        rest = [out async for out in stream]
    assert len(first.token_ids) < 40 and len(rest) == 1
    assert rest[0].finished and len(rest[0].token_ids) == 40
