"""Serving on a local Ray cluster (prefill on the head, decode on another node) through
the HTTP server: greedy tokens equal the single-process engine's under every policy,
streamed and whole, with the official `openai` client; 200 streams of which 30 % vanish
leave no KV block allocated on any node."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from aserve.cluster.engine import ClusterEngine, start_workers
from aserve.engine.config import ServerConfig
from aserve.entrypoints.server import ENGINE as ENGINE_KEY
from scheduler import POLICIES
from tests.aserve.conftest import API_KEY, MODEL, LiveServer, openai_client, read_metrics
from tests.cluster.conftest import NEEDS_RAY, LocalCluster, cluster_config, ray
from tests.conftest import make_config

pytest.importorskip("ray", reason=NEEDS_RAY)

PROMPTS = ["Hello, my name is", [2, 50, 60, 70, 80], "The capital of France is a city that",
           "a"]
MAX_TOKENS = 10
# small enough that the prompts do not all decode in one batch under every policy
ENGINE = dict(max_batch_size=2, num_decode_blocks=64)


@pytest.fixture(scope="module")
def workers(local_cluster: LocalCluster) -> Iterator[dict[str, Any]]:
    """A prefill and a decode worker with the model loaded, shared by the module's engines
    (each opens its own KV stores on them)."""
    started = start_workers(cluster_config(local_cluster.address))
    try:
        yield started
    finally:
        for worker in started.values():
            ray.kill(worker, no_restart=True)


def greedy(client: openai.OpenAI) -> tuple[list[list[str]], list[list[str]]]:
    """The greedy tokens of every prompt: whole (one batched request) and streamed (one
    request each), as the logprobs' token strings."""
    args = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt=PROMPTS, **args)  # type: ignore[call-overload]
    tokens = [c.logprobs.tokens for c in sorted(whole.choices, key=lambda c: c.index)]
    streamed = []
    for prompt in PROMPTS:
        chunks = list(client.completions.create(prompt=prompt, stream=True, **args))  # type: ignore[call-overload]
        assert chunks[-1].choices[0].finish_reason == "length"
        streamed.append([t for c in chunks if c.choices and c.choices[0].logprobs
                         for t in c.choices[0].logprobs.tokens])
    return tokens, streamed


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_tokens_equal_the_single_process_engines(local_cluster: LocalCluster,
                                                        workers: dict[str, Any],
                                                        policy: str) -> None:
    with openai_client(make_config(policy=policy, **ENGINE)) as client:
        want = greedy(client)
    config = cluster_config(local_cluster.address, policy=policy, **ENGINE)
    with openai_client(config, ClusterEngine(config, workers=workers)) as client:
        got = greedy(client)
    assert all(len(tokens) == MAX_TOKENS for tokens in want[0])
    assert got == want
    assert got[0] == got[1]  # streamed as whole


NUM_CLIENTS = 200
VANISHING_SHARE = 0.3


async def _client(session: aiohttp.ClientSession, url: str, i: int, vanish: bool) -> bool:
    """One streamed request; a vanishing client closes its connection after the first
    chunk. Returns whether the stream ran to [DONE]."""
    body = {"model": MODEL, "prompt": [2, 3 + i % 50, 4 + i % 7], "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if vanish and line.startswith(b"data: "):
                resp.close()  # the client is gone: the connection drops mid-stream
                return False
            if line.strip() == b"data: [DONE]":
                return True
    return False


def test_vanishing_clients_leave_no_block_on_any_node(local_cluster: LocalCluster,
                                                      workers: dict[str, Any]) -> None:
    rng = random.Random(0)
    vanishing = set(rng.sample(range(NUM_CLIENTS), int(NUM_CLIENTS * VANISHING_SHARE)))
    config = cluster_config(local_cluster.address)
    server = LiveServer(config, ServerConfig(port=0, api_key=API_KEY),
                        ClusterEngine(config, workers=workers))
    server.start()
    try:
        async def run() -> list[bool]:
            connector = aiohttp.TCPConnector(limit=NUM_CLIENTS)
            async with aiohttp.ClientSession(connector=connector) as session:
                return await asyncio.gather(*(_client(session, server.url, i, i in vanishing)
                                              for i in range(NUM_CLIENTS)))
        done = asyncio.run(run())
        assert [i for i, d in enumerate(done) if not d] == sorted(vanishing)
        engine = server.app[ENGINE_KEY]

        async def idle() -> None:
            while engine.stats()["live"]:
                await asyncio.sleep(0.05)
        asyncio.run_coroutine_threadsafe(idle(), server.loop).result(timeout=60)
        engine.check_integrity()
        blocks = engine.blocks_by_node()  # type: ignore[attr-defined]
        assert len(blocks) == 2 and set(blocks.values()) == {0}, blocks
        assert len([e for e in engine.events if e.kind == "finish"]) == NUM_CLIENTS
        metrics = read_metrics(server.url)  # /metrics covers every node
        finished = 'aserve_requests_finished_total{finish_reason="%s"}'
        assert metrics[finished % "error"] == 0
        assert metrics[finished % "length"] >= NUM_CLIENTS - len(vanishing)
        assert metrics[finished % "length"] + metrics[finished % "abort"] == NUM_CLIENTS
        for instance, stores in (("prefill0", ("prefill0", "staging0", "host")),
                                 ("decode0", ("decode0",))):
            assert metrics[f'aserve_node_online{{instance="{instance}"}}'] == 1
            for store in stores:
                key = f'aserve_node_kv_blocks_used{{instance="{instance}",store="{store}"}}'
                assert metrics[key] == 0
    finally:
        server.stop()
