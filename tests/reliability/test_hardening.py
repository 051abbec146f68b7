"""What a web page or a careless client can send, on real loopback sockets: bodies that are
not JSON (415, nothing generated, the body never read), a foreign Host (421: DNS rebinding),
transfer codings other than chunked (501), CORS (off by default; preflight when on), /health
details only with the key, and errors that name the field and clip what they echo."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from aserve.engine.config import ServerConfig
from aserve.entrypoints.args import add_server_args, server_config_from_args
from aserve.entrypoints.guard import GUARD_CONFIG, is_allowed_host
from aserve.entrypoints.server import create_app
from tests.aserve.conftest import API_KEY, AUTH, MODEL, server_engine_config
from tests.reliability.conftest import GuardedLiveServer, raw_exchange

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")
EXTRA_HOST = "aserve.internal"
ORIGIN = "http://app.example"
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def server() -> Iterator[GuardedLiveServer]:
    srv = GuardedLiveServer(server_engine_config(), ServerConfig(
        port=0, api_key=API_KEY, allowed_hosts=(EXTRA_HOST,)))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


async def _post(server: GuardedLiveServer, data: bytes | aiohttp.FormData,
                headers: dict[str, str]) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{server.url}/v1/completions", data=data, headers={**AUTH, **headers}) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None,
                                          "application/json; charset=latin-1"])
async def test_a_body_that_is_not_json_gets_415_and_generates_nothing(
        server: GuardedLiveServer, content_type: str | None) -> None:
    num_events = len(server.engine.events)
    headers = {} if content_type is None else {"Content-Type": content_type}
    data = json.dumps(BODY).encode()
    if content_type is None:  # aiohttp would add application/octet-stream to bytes
        data = aiohttp.FormData(BODY)  # type: ignore[assignment]
    status, payload = await _post(server, data, headers)
    assert status == 415, payload
    assert payload["error"]["param"] == "Content-Type"  # type: ignore[index]
    assert len(server.engine.events) == num_events  # no request reached the engine


async def test_415_comes_before_the_body_is_read(server: GuardedLiveServer) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: 100000\r\n\r\n" % API_KEY.encode())
    received, _ = await raw_exchange(server.port, [head])  # the body never comes
    assert received.startswith(b"HTTP/1.1 415"), received[:200]


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/health", "/v1/completions"])
async def test_a_foreign_host_gets_421(server: GuardedLiveServer, path: str) -> None:
    method = "POST" if path == "/v1/completions" else "GET"
    async with aiohttp.ClientSession() as session:
        for host, status in (("evil.example", 421), ("evil.example:8000", 421),
                             (f"localhost:{server.port}", None), (EXTRA_HOST, None)):
            async with session.request(method, f"{server.url}{path}", json=BODY,
                                       headers={**AUTH, "Host": host}) as resp:
                if status is None:
                    assert resp.status != 421, (host, await resp.text())
                else:
                    assert resp.status == status, (host, await resp.text())
                    assert (await resp.json())["error"]["code"] == "host_not_allowed"


async def test_a_request_without_host_gets_400(server: GuardedLiveServer) -> None:
    received, _ = await raw_exchange(server.port, [b"GET /health HTTP/1.1\r\n\r\n"])
    assert received.split(b" ", 2)[1] == b"400", received[:200]


@pytest.mark.parametrize("coding, status", [("gzip, chunked", b"501"), ("deflate,chunked", b"501"),
                                            ("chunked, chunked", b"400")])  # aiohttp's 400
async def test_unsupported_transfer_codings_are_refused(server: GuardedLiveServer, coding: str,
                                                        status: bytes) -> None:
    body = json.dumps(BODY).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nAuthorization: Bearer %s\r\nTransfer-Encoding: %s\r\n"
            b"Connection: close\r\n\r\n" % (API_KEY.encode(), coding.encode()))
    received, _ = await raw_exchange(server.port, [head + b"%x\r\n%s\r\n0\r\n\r\n"
                                                   % (len(body), body)])
    assert received.split(b" ", 2)[1] == status, received[:300]


async def test_chunked_json_is_served(server: GuardedLiveServer) -> None:
    body = json.dumps(BODY).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nAuthorization: Bearer %s\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n" % API_KEY.encode())
    received, _ = await raw_exchange(server.port, [head + b"%x\r\n%s\r\n0\r\n\r\n"
                                                   % (len(body), body)])
    assert received.startswith(b"HTTP/1.1 200"), received[:300]


async def test_health_details_only_with_the_key(server: GuardedLiveServer) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/health") as resp:
            assert resp.status == 200 and await resp.json() == {"status": "ok",
                                                                "healthy": True}
        async with session.get(f"{server.url}/health", headers=AUTH) as resp:
            assert "prefill0" in (await resp.json())["actors"]


@pytest.mark.parametrize("body, status, param, needle", [
    ({"prompt": "x " * 50_000}, 400, "prompt", "context"),
    ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "context"),
    ({"model": "m" * 500_000}, 404, "model", "500000 characters"),
    ({"prompt": ["a"] * 10_000}, 400, "prompt", "max_request_prompts (4096)"),
    ({"prompt": [[5] * 1000] * 300, "max_tokens": 3000}, 400, "prompt",
     "max_request_tokens (1048576)"),
], ids=["long_prompt", "max_tokens_over_context", "huge_model_name", "10000_prompts",
        "too_many_tokens"])
async def test_errors_name_the_field_and_clip_echoes(server: GuardedLiveServer,
                                                     body: dict[str, object], status: int,
                                                     param: str, needle: str) -> None:
    got, payload = await _post(server, json.dumps({**BODY, **body}).encode(),
                               {"Content-Type": "application/json"})
    error: dict[str, str] = payload["error"]  # type: ignore[assignment]
    assert got == status and error["param"] == param and needle in error["message"], error
    assert len(error["message"]) < 300  # nothing the client sent is echoed whole


# -- CORS ----------------------------------------------------------------------------------
@pytest_asyncio.fixture(loop_scope="module", scope="module", params=[(), (ORIGIN,)],
                        ids=["cors_off", "cors_on"])
async def cors_client(request: pytest.FixtureRequest) -> AsyncIterator[TestClient]:
    app = create_app(server_engine_config(), ServerConfig(api_key=API_KEY,
                                                          allowed_origins=request.param))
    async with TestClient(TestServer(app)) as client:
        yield client


PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@MODULE_LOOP
async def test_cors_preflight_and_response_headers(cors_client: TestClient) -> None:
    is_on = ORIGIN in cors_client.server.app[GUARD_CONFIG].allowed_origins
    pre = await cors_client.options("/v1/completions", headers={"Origin": ORIGIN, **PREFLIGHT})
    allowed = pre.headers.get("Access-Control-Allow-Origin")
    resp = await cors_client.post("/v1/completions", json=BODY, headers={**AUTH,
                                                                        "Origin": ORIGIN})
    assert resp.status == 200
    if is_on:
        assert pre.status == 200 and allowed == ORIGIN
        assert "authorization" in pre.headers["Access-Control-Allow-Headers"].lower()
        assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN
        other = await cors_client.options("/v1/completions",
                                          headers={"Origin": "http://evil.example", **PREFLIGHT})
        assert other.status == 403 and "Access-Control-Allow-Origin" not in other.headers
    else:
        assert pre.status >= 400 and allowed is None
        assert "Access-Control-Allow-Origin" not in resp.headers


def test_server_options_parse_from_flags_and_environment() -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser, env={"ASERVE_ALLOWED_HOSTS": "a.example, b.example",
                                 "ASERVE_MAX_CONNECTIONS": "64", "ASERVE_HEALTH_DETAILS": "1"})
    config = server_config_from_args(parser.parse_args(
        ["--allowed-origins", "https://x.example", "--body-timeout", "2.5"]), env={})
    assert config.allowed_hosts == ("a.example", "b.example")
    assert config.allowed_origins == ("https://x.example",)
    assert (config.max_connections, config.body_timeout, config.health_details) == (64, 2.5, True)
    assert server_config_from_args(_parsed([]), env={}) == ServerConfig()


def _parsed(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_args(parser, env={})
    return parser.parse_args(argv)


@pytest.mark.parametrize("host, allowed", [
    ("localhost", True), ("LOCALHOST.:8000", True), ("127.0.0.1:1", True), ("[::1]:8000", True),
    ("aserve.internal", True), ("evil.example", False), ("127.0.0.1.evil.example", False),
    ("[::2]", False), ("", False)])
def test_host_names_are_matched_without_port_case_or_trailing_dot(host: str,
                                                                 allowed: bool) -> None:
    class NoTransport:
        transport = None

    config = ServerConfig(allowed_hosts=(EXTRA_HOST,))
    assert is_allowed_host(host, NoTransport(), config) is allowed  # type: ignore[arg-type]
