"""Server fixtures: a real server on an ephemeral port in a background thread (its own event
loop), shared per test module, plus helpers to read /metrics."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from aserve.engine.config import EngineConfig, ServerConfig
from aserve.engine.engine import Engine
from tests.conftest import make_config

if TYPE_CHECKING:  # imported where used, so the GPU tests here run without the openai package
    import openai

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "opt-tiny"


def server_engine_config(**kwargs: object) -> EngineConfig:
    """opt-tiny on the CPU in float32 with small caches (see tests/conftest.py)."""
    return make_config(MODEL, **kwargs)  # type: ignore[no-any-return]


@asynccontextmanager
async def server_client(max_body_bytes: int) -> AsyncIterator[TestClient]:
    """An in-process client of the app on the test engine, with API_KEY required and
    request bodies capped at ``max_body_bytes``."""
    from aserve.entrypoints.server import create_app

    app = create_app(server_engine_config(),
                     ServerConfig(api_key=API_KEY, max_body_bytes=max_body_bytes))
    async with TestClient(TestServer(app)) as client:
        yield client


class LiveServer:
    """`create_app` served by `AppRunner` + `TCPSite(port=0)` on a thread with its own loop."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                 engine: Engine | None = None) -> None:
        from aserve.entrypoints.server import create_app

        self.app = create_app(engine_config, server_config, engine)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="live-server",
                                       daemon=True)
        self.runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=5)
        self.port = 0

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=120)

    async def _start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def openai_client(engine_config: EngineConfig, engine: Engine | None = None
                  ) -> Iterator[openai.OpenAI]:
    """A LiveServer of `engine_config` (or of `engine`) requiring API_KEY, and the official
    openai client on it, as a user calls it (no retries)."""
    import openai

    server = LiveServer(engine_config, ServerConfig(port=0, api_key=API_KEY), engine)
    server.start()
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=60) as client:
            yield client
    finally:
        server.stop()


@pytest.fixture(scope="module")
def live_server() -> Iterator[LiveServer]:
    server = LiveServer(server_engine_config(), ServerConfig(port=0, api_key=API_KEY))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line of a Prometheus text exposition."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def read_metrics(url: str, api_key: str | None = API_KEY) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{url}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as resp:
        return parse_metrics(resp.read().decode())
