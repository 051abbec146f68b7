"""The HTTP server on the real opt-tiny engine: the SSE stream format, batches, the side
routes (models, health, metrics, openapi), 64 streaming clients of which half disconnect,
and `aserve serve --model opt-125m` as a process (health within a 60 s start-up deadline,
SIGTERM exits 0)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from http.client import HTTPResponse
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from aserve.engine.config import ServerConfig
from aserve.entrypoints.server import create_app
from tests.aserve.conftest import (
    API_KEY,
    AUTH,
    MODEL,
    LiveServer,
    parse_metrics,
    read_metrics,
    server_engine_config,
)

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")
REPO = Path(__file__).resolve().parents[2]
LOCATIONS = ("decode", "staging", "host")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client() -> AsyncIterator[TestClient]:
    app = create_app(server_engine_config(), ServerConfig(api_key=API_KEY))
    async with TestClient(TestServer(app), headers=AUTH) as c:
        yield c


async def sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    body = await resp.text()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def body(**kwargs: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, **kwargs}


@MODULE_LOOP
async def test_stream_is_sse_chunks_ending_with_done(client: TestClient) -> None:
    resp = await client.post("/v1/completions", json=body(stream=True))
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length" and reasons[:-1] == [None] * (len(reasons) - 1)


@MODULE_LOOP
async def test_streamed_batch_finishes_every_index_once(client: TestClient) -> None:
    resp = await client.post("/v1/completions", json=body(
        prompt=["one", [2, 40, 41], "three"], stream=True,
        stream_options={"include_usage": True}))
    chunks = [json.loads(e) for e in (await sse_events(resp))[:-1]]
    finished = [c["choices"][0]["index"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2]
    assert chunks[-1]["usage"]["completion_tokens"] == 18


@MODULE_LOOP
async def test_non_streamed_batch_returns_one_choice_per_prompt(client: TestClient) -> None:
    resp = await client.post("/v1/completions", json=body(prompt=["a", "b"], max_tokens=3))
    assert resp.status == 200
    out = await resp.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 6


@MODULE_LOOP
async def test_health_needs_no_api_key(client: TestClient) -> None:
    resp = await client.get("/health", headers={"Authorization": ""})
    assert resp.status == 200 and (await resp.json())["status"] == "ok"


@MODULE_LOOP
async def test_metrics_count_finished_requests_and_tokens(client: TestClient) -> None:
    before = parse_metrics(await (await client.get("/metrics")).text())
    resp = await client.post("/v1/completions", json=body(max_tokens=5))
    assert resp.status == 200
    after = parse_metrics(await (await client.get("/metrics")).text())
    length = 'aserve_requests_finished_total{finish_reason="length"}'
    assert after[length] == before[length] + 1
    assert after["aserve_generation_tokens_total"] == before["aserve_generation_tokens_total"] + 5
    for name in ("aserve_time_to_first_token_seconds", "aserve_e2e_request_latency_seconds",
                 "aserve_time_per_output_token_seconds"):
        assert after[f"{name}_count"] == before[f"{name}_count"] + 1
    assert after["aserve_iteration_forward_seconds_count"] > 0
    assert "aserve_iteration_schedule_seconds_count" in after
    for loc in LOCATIONS:
        assert after[f'aserve_kv_blocks_total{{location="{loc}"}}'] > 0
    assert after["aserve_requests_running"] == 0 and after["aserve_requests_waiting"] == 0


@MODULE_LOOP
async def test_openapi_describes_the_request_fields(client: TestClient) -> None:
    doc = await (await client.get("/openapi.json")).json()
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    for field in ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed",
                  "stop", "ignore_eos", "min_tokens", "logprobs", "echo", "stream",
                  "stream_options", "n"):
        assert field in props
    assert "/v1/completions" in doc["paths"]


async def _stream_client(session: aiohttp.ClientSession, url: str, i: int) -> str | None:
    """Streams one completion; odd clients ask for far more tokens but hang up after two
    chunks (returns None), so their requests are surely still running."""
    payload = body(prompt=f"client {i} says", max_tokens=1000 if i % 2 else 40,
                   temperature=1.0, seed=i, stream=True)
    async with session.post(f"{url}/v1/completions", json=payload, headers=AUTH) as resp:
        assert resp.status == 200
        num_chunks, reason = 0, None
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            num_chunks += 1
            reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
            if i % 2 and num_chunks == 2:
                resp.close()  # the client disconnects mid-stream
                return None
        return reason


@MODULE_LOOP
async def test_disconnected_clients_free_everything_others_complete(
        live_server: LiveServer) -> None:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        results = await asyncio.wait_for(asyncio.gather(
            *(_stream_client(session, live_server.url, i) for i in range(64))), timeout=60)
    assert results[0::2] == ["length"] * 32
    deadline = time.monotonic() + 10.0  # a deadline to settle, not a timing check
    while True:
        metrics = await asyncio.to_thread(read_metrics, live_server.url)
        used = {k: v for k, v in metrics.items() if k.startswith("aserve_kv_blocks_used")}
        aborted = metrics['aserve_requests_finished_total{finish_reason="abort"}']
        # NOTE: the engine frees a request's blocks a moment before the handler's `finally`
        # counts its abort, so wait for all three within the deadline
        if metrics["aserve_requests_running"] == 0 and not any(used.values()) and aborted == 32:
            break
        assert time.monotonic() < deadline, (metrics["aserve_requests_running"], used, aborted)
        await asyncio.sleep(0.05)
    assert metrics['aserve_requests_finished_total{finish_reason="abort"}'] == 32
    assert set(used) == {f'aserve_kv_blocks_used{{location="{loc}"}}'
                         for loc in ("prefill", *LOCATIONS)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read()
    except OSError:
        return 0, b""


def _start_stream(port: int, payload: dict[str, object]) -> HTTPResponse:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    resp: HTTPResponse = urllib.request.urlopen(request, timeout=30)
    return resp


@pytest.mark.slow
def test_serve_opt_125m_answers_health_and_exits_0_on_sigterm() -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve.entrypoints.cli", "serve", "--model", "opt-125m", "--port",
         str(port)], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        start, status = time.monotonic(), 0
        while time.monotonic() - start < 60 and proc.poll() is None and status != 200:
            status, _ = _get(f"http://127.0.0.1:{port}/health")
            time.sleep(0.1)
        assert status == 200, f"no /health within 60 s (exit {proc.poll()})"
        with _start_stream(port, body(max_tokens=1500, stream=True, model="opt-125m")) as resp:
            assert resp.readline().startswith(b"data: {")
            proc.send_signal(signal.SIGTERM)
            rest = resp.read()  # the in-flight request is aborted, its stream closed
        assert b'"finish_reason":"abort"' in rest and rest.endswith(b"data: [DONE]\n\n")
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=10)
    assert b"Traceback" not in err, err.decode()[-2000:]
