"""Security: loopback bind by default; the API key is compared in constant time and guards
every route but /health; bodies and prompts are bounded; checkpoints load only as safetensors
or weights-only pickles (a pickle that would run code is refused, end to end through Engine);
and no path a client sends is ever opened."""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from aiohttp.test_utils import TestClient

import aserve.entrypoints.server
from aserve import Engine, SamplingParams
from aserve.engine.config import ServerConfig
from aserve.entrypoints.args import add_server_args, server_config_from_args
from tests.aserve.conftest import API_KEY, AUTH, MODEL, server_client
from tests.aserve.test_engine import collect, settle
from tests.conftest import make_config, write_hf_checkpoint

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")
MAX_BODY_BYTES = 8 * 1024
CONTEXT = 4096  # opt-tiny's positions


def test_default_bind_is_loopback() -> None:
    assert ServerConfig().host == "127.0.0.1"
    parser = argparse.ArgumentParser()
    add_server_args(parser, env={})
    assert server_config_from_args(parser.parse_args([]), env={}).host == "127.0.0.1"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client() -> AsyncIterator[TestClient]:
    async with server_client(MAX_BODY_BYTES) as c:
        yield c


def _routes(client: TestClient) -> list[tuple[str, str]]:
    return sorted({(r.method, r.resource.canonical) for r in client.server.app.router.routes()
                   if r.resource is not None})


@MODULE_LOOP
async def test_every_route_but_the_liveness_probes_needs_the_key(client: TestClient) -> None:
    routes = _routes(client)
    assert ("POST", "/v1/completions") in routes and ("GET", "/health") in routes
    for method, path in routes:
        bare = await client.request(method, path)
        keyed = await client.request(method, path, headers=AUTH)
        if path in aserve.entrypoints.server.PUBLIC_PATHS:  # /health and /ping
            assert bare.status == 200, (method, path)
        else:
            assert bare.status == 401, (method, path)
            assert keyed.status != 401, (method, path)


@MODULE_LOOP
async def test_api_key_is_compared_in_constant_time(client: TestClient,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = aserve.entrypoints.server.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(aserve.entrypoints.server.hmac, "compare_digest", spy)
    for token in (API_KEY, API_KEY[:-1] + "x", "short", API_KEY * 3):
        await client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
    assert [a for a, _ in compared] == [t.encode() for t in
                                        (API_KEY, API_KEY[:-1] + "x", "short", API_KEY * 3)]
    assert all(b == API_KEY.encode() for _, b in compared)


def _body_of_size(size: int) -> bytes:
    """A valid completions body of exactly `size` bytes (a token-id prompt of 100s)."""
    head, tail = f'{{"model": "{MODEL}", "max_tokens": 1, "prompt": [100'.encode(), b"]}"
    num_ids, pad = divmod(size - len(head) - len(tail), 4)
    return head + b",100" * num_ids + b" " * pad + tail


@MODULE_LOOP
@pytest.mark.parametrize("size, status", [(MAX_BODY_BYTES, 200), (MAX_BODY_BYTES + 1, 413)])
async def test_request_body_is_bounded(client: TestClient, size: int, status: int) -> None:
    data = _body_of_size(size)
    assert len(data) == size
    resp = await client.post("/v1/completions", data=data,
                             headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status == status, await resp.text()
    if status == 413:
        assert (await resp.json())["error"]["param"] == "body"


@MODULE_LOOP
@pytest.mark.parametrize("prompt, max_tokens", [("x" * CONTEXT, 1), ([7] * 3000, 1200)],
                         ids=["text_over_context", "ids_plus_max_tokens_over_context"])
async def test_prompt_length_is_bounded_by_the_context(client: TestClient,
                                                       prompt: str | list[int],
                                                       max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    resp = await client.post("/v1/completions", data=json.dumps(body, separators=(",", ":")),
                             headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status == 400 and "context" in (await resp.json())["error"]["message"]


# -- checkpoints -------------------------------------------------------------------------
class Exploit:
    """Unpickling this creates a directory: proof that a pickle ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _bin_checkpoint(path: Path, weights: dict[str, object]) -> Path:
    write_hf_checkpoint(path)
    (path / "model.safetensors").unlink()
    torch.save(weights, path / "pytorch_model.bin")
    return path


async def test_engine_refuses_a_pickle_that_would_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = _bin_checkpoint(tmp_path / "ckpt", {"lm_head.weight": Exploit(marker)})
    with pytest.raises(ValueError, match="refusing .*pytorch_model.bin: not a plain weights"):
        async with Engine(make_config(str(ckpt))):
            pass
    assert not marker.exists()


async def test_engine_loads_a_plain_weights_pickle(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    source = write_hf_checkpoint(tmp_path / "source")
    ckpt = _bin_checkpoint(tmp_path / "ckpt", load_file(source / "model.safetensors"))
    async with Engine(make_config(str(ckpt))) as engine:
        out = await collect(engine, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.token_ids) == 3
        await settle(engine)


# -- no client-supplied path is opened ------------------------------------------------------
class OpenedPaths:
    """A process audit hook (it cannot be removed, so it switches itself off) recording
    every filesystem access whose path contains `marker`."""

    EVENTS = ("open", "os.listdir", "os.scandir", "os.stat", "os.mkdir", "os.remove",
              "os.rename", "os.chdir", "glob.glob", "shutil.copyfile", "pathlib.Path.glob")

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.hits: list[tuple[str, str]] = []
        self.is_on = True
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[object, ...]) -> None:
        if self.is_on and event in self.EVENTS and args and self.marker in str(args[0]):
            self.hits.append((event, str(args[0])))


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[tuple[OpenedPaths, Path]]:
    secret = tmp_path / f"secret-{uuid.uuid4().hex}"
    secret.mkdir()
    (secret / "config.json").write_text("{}")
    watcher = OpenedPaths(secret.name)
    yield watcher, secret
    watcher.is_on = False


@MODULE_LOOP
async def test_no_client_supplied_path_is_opened(client: TestClient,
                                                 opened: tuple[OpenedPaths, Path]) -> None:
    watcher, secret = opened
    (secret / "config.json").read_text()  # the watcher sees an open of the path…
    assert watcher.hits and watcher.hits[0][0] == "open"
    watcher.hits.clear()  # …and from here on only the server's
    paths = [str(secret), str(secret / "config.json"), f"file://{secret}",
             f"../../../..{secret}"]
    for path in paths:
        for body in ({"model": path, "prompt": "a"}, {"model": MODEL, "prompt": path,
                                                     "max_tokens": 1, "stop": [path],
                                                     "user": path}):
            resp = await client.post("/v1/completions", json=body, headers=AUTH)
            assert resp.status in (200, 404)
        for url in (f"/v1/models{secret}", f"/files{secret}", f"/static/..%2f..{secret}"):
            assert (await client.get(url, headers=AUTH)).status == 404
    assert watcher.hits == []
