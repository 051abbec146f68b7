"""A decode node dies mid-run on a local three-node Ray cluster (prefill on the head, two
decode nodes): the requests decoding there end with a clear error within a bounded time
(HTTP 503 with Retry-After, or finish_reason "error" in the stream), the others finish,
every surviving node's allocator is intact with no block left, and a node that joins in
its place is used again."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import openai
import pytest

from aserve.engine.config import ServerConfig
from aserve.entrypoints.server import ENGINE
from tests.aserve.conftest import API_KEY, MODEL, LiveServer
from tests.cluster.conftest import NEEDS_RAY, LocalCluster, cluster_config

pytest.importorskip("ray", reason=NEEDS_RAY)

T = TypeVar("T")
NUM_REQUESTS = 12
MAX_TOKENS = 400  # long enough to be decoding when the node dies
DEADLINE_S = 60.0  # every request ends within this after the kill
ENGINE_ARGS = dict(decode_devices=("cpu", "cpu"), max_batch_size=4, num_decode_blocks=64,
              policy="fcfs")


def health(url: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"{url}/health",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def ask(client: openai.OpenAI, i: int) -> tuple[str, float]:
    """One request, streamed when `i` is odd: how it ended, and when."""
    args = dict(model=MODEL, prompt=[2, 10 + i, 20 + i, 30 + i], max_tokens=MAX_TOKENS,
                temperature=0, extra_body={"ignore_eos": True})
    try:
        if i % 2:
            chunks = list(client.completions.create(stream=True, **args))  # type: ignore[call-overload]
            reason = chunks[-1].choices[0].finish_reason
        else:
            reason = client.completions.create(**args).choices[0].finish_reason  # type: ignore[call-overload]
    except openai.APIStatusError as exc:
        assert exc.response.headers.get("Retry-After"), "a 503 tells when to retry"
        reason = f"http {exc.status_code}"
    return str(reason), time.monotonic()


def test_a_dead_decode_node_ends_its_requests_and_spares_the_rest(
        local_cluster: LocalCluster) -> None:
    config = cluster_config(local_cluster.address, **ENGINE_ARGS)
    server = LiveServer(config, ServerConfig(port=0, api_key=API_KEY))
    server.start()
    engine: Any = server.app[ENGINE]
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=120) as client, ThreadPoolExecutor(NUM_REQUESTS) as pool:
            futures = [pool.submit(ask, client, i) for i in range(NUM_REQUESTS)]
            while not (engine.transfers and any(t.dst == "decode1" for t in engine.transfers)
                       and any(t.dst == "decode0" for t in engine.transfers)):
                time.sleep(0.05)
            time.sleep(0.3)  # both decode instances are mid-batch
            at_risk = on_loop(server, lambda: [s.seq_id for s in engine._live.values()
                                                if s.location in ("decode0", "staging0")])
            dead_node = engine.nodes["decode0"]
            killed_at = time.monotonic()
            local_cluster.kill(dead_node)
            results = [f.result(timeout=DEADLINE_S + 60) for f in futures]
        reasons = [r for r, _ in results]
        assert max(at for _, at in results) - killed_at < DEADLINE_S
        failed = {i for i, r in enumerate(reasons) if r != "length"}
        assert failed, "the requests decoding on the dead node end with an error"
        assert all(reasons[i] in ("error", "http 503") for i in failed), reasons
        # only requests decoding on (or being admitted to) the dead node fail
        assert len(failed) <= len(at_risk) < NUM_REQUESTS
        status, report = health(server.url)
        assert status == 503 and not report["nodes"]["decode0"]["online"]
        assert report["nodes"]["decode1"]["online"]
        _wait_idle(server, engine)
        engine.check_integrity()
        assert set(engine.blocks_by_node().values()) == {0}  # on every surviving node

        # a node that joins in its place is used again
        local_cluster.add_decode_node()
        deadline = time.monotonic() + DEADLINE_S
        while health(server.url)[0] != 200:
            assert time.monotonic() < deadline, health(server.url)
            time.sleep(0.5)
        assert engine.nodes["decode0"] != dead_node
        num_before = len(engine.transfers)
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=120) as client, ThreadPoolExecutor(8) as pool:
            again = list(pool.map(lambda i: client.completions.create(
                model=MODEL, prompt=[2, 5, i], max_tokens=30, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].finish_reason, range(8)))
        assert again == ["length"] * 8
        assert any(t.dst == "decode0" for t in engine.transfers[num_before:])
        _wait_idle(server, engine)
        engine.check_integrity()
        assert set(engine.blocks_by_node().values()) == {0}
    finally:
        server.stop()


def on_loop(server: LiveServer, fn: Callable[[], T]) -> T:
    """`fn()` on the server's event loop (the engine's state is that loop's)."""
    async def call() -> T:
        return fn()
    return asyncio.run_coroutine_threadsafe(call(), server.loop).result(timeout=30)


def _wait_idle(server: LiveServer, engine: Any) -> None:
    """Until the engine holds no request (ended ones free their blocks at a step)."""
    async def idle() -> None:
        while engine.stats()["live"]:
            await asyncio.sleep(0.05)
    asyncio.run_coroutine_threadsafe(idle(), server.loop).result(timeout=30)
