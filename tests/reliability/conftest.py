"""Shared helpers of the reliability tests: single-threaded torch, block accounting, and an
in-process server that synchronous (hypothesis) tests drive on their own event loop.

NOTE: torch's intra-op threads spin when the 2 cores are shared: a tiny forward then takes
~300 ms instead of ~2 ms, so these tests pin torch to one thread while they run.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from typing import TypeVar

import pytest
from aiohttp.test_utils import TestClient, TestServer

from aserve.engine.config import EngineConfig, ServerConfig
from aserve.engine.engine import Engine
from aserve.engine.runner import WorkItem
from aserve.entrypoints.guard import GuardedRunner
from aserve.entrypoints.server import ENGINE, create_app
from tests.aserve.conftest import LiveServer
from tests.aserve.test_engine import settle
from transport.blocks import BlockAllocator

T = TypeVar("T")


@pytest.fixture(autouse=True, scope="module")
def single_thread_torch() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class BlockLedger:
    """Counts, per KV store and owner, every allocation and every free of an engine's
    allocators, so that a test can prove each block table was freed exactly once."""

    def __init__(self, engine: Engine) -> None:
        assert engine.ctx is not None, "start the engine first"
        self.allocs: Counter[tuple[str, str]] = Counter()
        self.frees: Counter[tuple[str, str]] = Counter()
        for name, store in engine.ctx.kv.stores.items():
            allocator = store.allocator
            allocator.allocate = self._wrap(name, allocator.allocate, self.allocs)  # type: ignore[method-assign]
            allocator.free = self._wrap(name, allocator.free, self.frees)  # type: ignore[method-assign]
            allocator.adopt = self._wrap_adopt(name, allocator.adopt)  # type: ignore[method-assign]

    @staticmethod
    def _wrap(name: str, fn: Callable[..., object],
              counts: Counter[tuple[str, str]]) -> Callable[..., object]:
        def counted(owner: str, *args: object) -> object:
            result = fn(owner, *args)
            if result is not None:
                counts[(name, owner)] += 1
            return result
        return counted

    def _wrap_adopt(self, name: str, fn: Callable[..., int]) -> Callable[..., int]:
        """A hand-over between stores of one KV tensor: the table is allocated in `name`
        and freed in the source store, as a copy's would be (transport/blocks.py)."""
        def counted(owner: str, src: BlockAllocator) -> int:
            result = fn(owner, src)
            self.allocs[(name, owner)] += 1
            self.frees[(src.name, owner)] += 1
            return result
        return counted

    def unbalanced(self, seq_id: str | None = None) -> dict[tuple[str, str], tuple[int, int]]:
        """(store, owner) -> (allocations, frees) wherever the two differ."""
        keys = set(self.allocs) | set(self.frees)
        return {k: (self.allocs[k], self.frees[k]) for k in keys
                if self.allocs[k] != self.frees[k] and seq_id in (None, k[1])}

    def stores_of(self, seq_id: str) -> set[str]:
        return {name for name, owner in self.allocs if owner == seq_id}


class Gate:
    """Holds the calls of an async method of `obj` for which `when(*args)` holds until
    `open()`: a test parks an actor at a chosen point and inspects the engine meanwhile."""

    def __init__(self, obj: object, method: str,
                 when: Callable[..., bool] = lambda *args: True) -> None:
        self.entered = asyncio.Event()  # set once a call is being held
        self._is_open = asyncio.Event()
        original = getattr(obj, method)

        async def gated(*args: object) -> object:
            if not self._is_open.is_set() and when(*args):
                self.entered.set()
                await self._is_open.wait()
            return await original(*args)

        setattr(obj, method, gated)

    def open(self) -> None:
        self._is_open.set()


def is_prefill(items: list[WorkItem], *rest: object) -> bool:
    """Whether a runner step computes some sequence's prompt (a prefill)."""
    return any(item.start == 0 for item in items)


def is_decode(items: list[WorkItem], *rest: object) -> bool:
    return not is_prefill(items)


async def wait_for_event(engine: Engine, seq_id: str, kind: str, timeout: float = 10) -> None:
    """Waits until the engine has recorded lifecycle event `kind` for `seq_id`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not any(e.seq_id == seq_id and e.kind == kind for e in engine.events):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{seq_id} never reached {kind!r}")
        await asyncio.sleep(0.005)


class SyncServer:
    """`create_app` behind aiohttp's test client on a private event loop, for synchronous
    tests (hypothesis drives them); the engine's actors run whenever the loop does."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.client: TestClient = self.run(_started_client(engine_config, server_config))

    def run(self, coro: Coroutine[object, object, T]) -> T:
        return self.loop.run_until_complete(coro)

    @property
    def engine(self) -> Engine:
        return self.client.server.app[ENGINE]

    def settle(self) -> None:
        """Waits until every request has ended and every KV block is free."""
        self.run(settle(self.engine, timeout=30))

    def close(self) -> None:
        self.run(self.client.close())
        self.loop.close()


async def _started_client(engine_config: EngineConfig,
                          server_config: ServerConfig) -> TestClient:
    client = TestClient(TestServer(create_app(engine_config, server_config)))
    await client.start_server()
    return client


class GuardedLiveServer(LiveServer):
    """A LiveServer on `GuardedRunner`, as `aserve serve` runs: connection limits included."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        super().__init__(engine_config, server_config)
        self.runner = GuardedRunner(self.app, server_config, handler_cancellation=True,
                                    shutdown_timeout=5)

    @property
    def engine(self) -> Engine:
        return self.app[ENGINE]


async def raw_exchange(port: int, chunks: list[bytes], pause: float = 0.0,
                       timeout: float = 30.0) -> tuple[bytes, float]:
    """Sends `chunks` on a fresh loopback socket, `pause` seconds apart, then reads until the
    server closes. Returns what arrived and the seconds from connecting to the close; a
    server that closes while chunks remain ends the sending too."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.perf_counter()
    received = bytearray()

    async def read_all() -> None:
        try:
            while data := await reader.read(65536):
                received.extend(data)
        except ConnectionError:
            pass

    reading = asyncio.create_task(read_all())
    try:
        for chunk in chunks:
            if reading.done():
                break
            writer.write(chunk)
            await writer.drain()
            await asyncio.wait([reading], timeout=pause)
        await asyncio.wait_for(reading, timeout)
    except ConnectionError:
        await asyncio.wait_for(reading, timeout)
    finally:
        writer.close()
    return bytes(received), time.perf_counter() - start
