"""Cancellation and shutdown: an abort in every state of a request (waiting for prefill, in
prefill, in the host pool, staged, decoding) ends it with finish_reason "abort" and frees each
of its block tables exactly once; SIGTERM during load ends every open stream and exits 0.

States are reached deterministically by holding an actor at a gate (see conftest.Gate)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from aserve import Engine, SamplingParams
from aserve.engine.sequence import RequestOutput
from tests.aserve.test_engine import collect, settle
from tests.conftest import make_config
from tests.reliability.conftest import BlockLedger, Gate, is_decode, is_prefill, wait_for_event

REPO = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT = list(range(10, 30))


class Scene:
    """An engine with a block ledger and helpers to start and abort requests."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ledger = BlockLedger(engine)
        self.runner = next(iter(engine.ctx.runners.values()))  # type: ignore[union-attr]
        self.tasks: dict[str, asyncio.Task[RequestOutput]] = {}

    def start(self, request_id: str) -> None:
        self.tasks[request_id] = asyncio.ensure_future(
            collect(self.engine, PROMPT, PARAMS, request_id))

    async def finish(self) -> dict[str, RequestOutput]:
        """Waits for every request, then for every block to be free; checks the books."""
        outs = dict(zip(self.tasks, await asyncio.wait_for(
            asyncio.gather(*self.tasks.values()), timeout=30)))
        await settle(self.engine)
        assert self.ledger.unbalanced() == {}
        assert all(a.num_errors == 0 for a in self.engine.actors), self.engine.health()
        return outs

    def assert_aborted(self, outs: dict[str, RequestOutput], seq_id: str,
                       stores: set[str]) -> None:
        assert outs[seq_id].finish_reason == "abort"
        assert self.ledger.stores_of(seq_id) == stores
        others = [o for rid, o in outs.items() if rid != seq_id]
        assert all(o.finish_reason == "length" and len(o.token_ids) == PARAMS.max_tokens
                   for o in others), others


# NOTE: a Gate on the runner parks one instance's step while the others go on; with fused
# steps it would park every instance of the device at once
@pytest_asyncio.fixture(params=["aligned", "continuous"])
async def scene(request: pytest.FixtureRequest) -> AsyncIterator[Scene]:
    async with Engine(make_config(policy=request.param, fuse_steps=False)) as engine:
        yield Scene(engine)


@pytest_asyncio.fixture
async def aligned() -> AsyncIterator[Scene]:
    async with Engine(make_config(policy="aligned", fuse_steps=False)) as engine:
        yield Scene(engine)


def _scratch(scene: Scene) -> str:
    return "prefill0" if scene.engine.ctx.policy.uses_pool else "decode0"  # type: ignore[union-attr]


async def test_abort_while_waiting_for_prefill_frees_nothing_twice(scene: Scene) -> None:
    gate = Gate(scene.runner, "execute", is_prefill)
    scene.start("busy")
    await gate.entered.wait()
    scene.start("victim")
    await asyncio.sleep(0)
    assert scene.engine.num_waiting == 1
    scene.engine.abort("victim")
    gate.open()
    scene.assert_aborted(await scene.finish(), "victim", set())


async def test_abort_during_prefill_frees_its_blocks_once(scene: Scene) -> None:
    gate = Gate(scene.runner, "execute", is_prefill)
    scene.start("victim")
    await gate.entered.wait()
    scene.engine.abort("victim")
    gate.open()
    scene.assert_aborted(await scene.finish(), "victim", {_scratch(scene)})


async def test_abort_while_decoding_frees_its_blocks_once(scene: Scene) -> None:
    gate = Gate(scene.runner, "execute", is_decode)
    scene.start("victim")
    await gate.entered.wait()
    scene.engine.abort("victim")
    gate.open()
    stores = {"prefill0", "host", "staging0", "decode0"} if scene.engine.ctx.policy.uses_pool \
        else {"decode0"}  # type: ignore[union-attr]
    scene.assert_aborted(await scene.finish(), "victim", stores)


async def test_abort_in_the_host_pool_frees_its_blocks_once(aligned: Scene) -> None:
    batcher = aligned.engine.ctx.wiring.batcher  # type: ignore[union-attr]
    gate = Gate(batcher, "act")  # nothing leaves the pool
    aligned.start("victim")
    await wait_for_event(aligned.engine, "victim", "pooled")
    await gate.entered.wait()
    aligned.engine.abort("victim")
    await wait_for_event(aligned.engine, "victim", "finish")
    gate.open()
    aligned.start("after")  # the engine still serves
    aligned.assert_aborted(await aligned.finish(), "victim", {"prefill0", "host"})


async def test_abort_when_staged_frees_its_blocks_once(aligned: Scene) -> None:
    gate = Gate(aligned.runner, "execute", is_decode)
    aligned.start("busy")
    await gate.entered.wait()  # "busy" decodes; the decode actor is held mid-iteration
    aligned.start("victim")
    await wait_for_event(aligned.engine, "victim", "prefetched")
    aligned.engine.abort("victim")
    gate.open()
    aligned.assert_aborted(await aligned.finish(), "victim", {"prefill0", "host", "staging0"})


# -- SIGTERM -------------------------------------------------------------------------------
NUM_STREAMS = 6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 90) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession() as session:
        while asyncio.get_running_loop().time() < deadline:
            assert proc.poll() is None, "the server exited during start-up"
            try:
                async with session.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError("the server did not become healthy")


async def _read_stream(resp: aiohttp.ClientResponse, started: asyncio.Event) -> list[str]:
    events = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            events.append(line[6:].decode().strip())
            started.set()
    return events


async def test_sigterm_during_load_ends_every_stream_and_exits_0() -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve.entrypoints.cli", "--log-level", "WARNING", "serve",
         "--model", "opt-tiny", "--port", str(port), "--num-decode-blocks", "256",
         "--num-prefill-blocks", "256", "--num-staging-blocks", "256", "--host-pool-gb", "0.05"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_healthy(url, proc)
        body = {"model": "opt-tiny", "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True,
                "stream": True}
        async with aiohttp.ClientSession() as session:
            resps = await asyncio.gather(*(session.post(f"{url}/v1/completions", json=body)
                                           for _ in range(NUM_STREAMS)))
            started = [asyncio.Event() for _ in resps]
            readers = [asyncio.ensure_future(_read_stream(r, s)) for r, s in zip(resps, started)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)
            proc.send_signal(signal.SIGTERM)
            streams = await asyncio.wait_for(asyncio.gather(*readers), 30)
        for events in streams:
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])["choices"][0]
            assert last["finish_reason"] == "abort", last
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0].decode(errors="replace")
    assert "Traceback" not in output, output[-3000:]
