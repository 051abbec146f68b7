"""Bad requests get the documented status and an OpenAI error envelope naming the field;
random garbage never yields a 500; overload gives 429 and a stopped engine 503; the server stays
healthy throughout. Real opt-tiny engine behind aiohttp's test client."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from aserve.engine.config import ServerConfig
from aserve.entrypoints.server import ENGINE, create_app
from tests.aserve.conftest import API_KEY, AUTH, MODEL, server_client, server_engine_config
from tests.reliability.conftest import Gate

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")
MAX_BODY_BYTES = 64 * 1024
CONTEXT = 4096  # opt-tiny's max_position_embeddings


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client() -> AsyncIterator[TestClient]:
    async with server_client(MAX_BODY_BYTES) as c:
        yield c


def ok(**kwargs: object) -> dict[str, object]:
    """A valid body, with `kwargs` overriding (a value of None removes the field)."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **kwargs}
    return {k: v for k, v in body.items() if v is not None}


# (case id, JSON body or raw bytes, headers, status, param, text the message must contain)
CASES: list[tuple[str, object, dict[str, str] | None, int, str | None, str]] = [
    ("malformed_json", b'{"model": "opt-tiny", "prompt": ', None, 400, "body", "JSON"),
    ("body_not_object", b"[1, 2]", None, 400, None, "object"),
    ("missing_prompt", ok(prompt=None), None, 400, "prompt", "prompt"),
    ("prompt_wrong_type", ok(prompt=5), None, 400, "prompt", "prompt"),
    ("max_tokens_wrong_type", ok(max_tokens="ten"), None, 400, "max_tokens", "max_tokens"),
    ("max_tokens_zero", ok(max_tokens=0), None, 400, "max_tokens", "max_tokens"),
    ("max_tokens_negative", ok(max_tokens=-3), None, 400, "max_tokens", "max_tokens"),
    ("temperature_negative", ok(temperature=-0.5), None, 400, "temperature", "temperature"),
    ("top_p_over_1", ok(top_p=1.5), None, 400, "top_p", "top_p"),
    ("top_k_below_minus_1", ok(top_k=-2), None, 400, "top_k", "top_k"),
    ("logprobs_over_5", ok(logprobs=6), None, 400, "logprobs", "logprobs"),
    ("min_tokens_over_max", ok(min_tokens=5), None, 400, "min_tokens", "min_tokens"),
    ("empty_stop_string", ok(stop=[""]), None, 400, "stop", "stop"),
    ("over_context", ok(max_tokens=CONTEXT), None, 400, "max_tokens", "context"),
    ("token_id_outside_vocab", ok(prompt=[2, 99999]), None, 400, "prompt", "vocabulary"),
    ("negative_token_id", ok(prompt=[-1]), None, 400, "prompt", "prompt"),
    ("empty_prompt", ok(prompt=""), None, 400, "prompt", "empty"),
    ("empty_token_list", ok(prompt=[]), None, 400, "prompt", "empty"),
    ("empty_prompt_in_batch", ok(prompt=["a", ""]), None, 400, "prompt", "empty"),
    ("mixed_prompt_list", ok(prompt=[5, "a"]), None, 400, "prompt", "prompt"),
    ("n_0", ok(n=0), None, 400, "n", "n"),
    ("n_over_max", ok(n=33), None, 400, "n", "<= 32"),
    ("best_of_under_n", ok(n=2, best_of=1), None, 400, "best_of", "best_of"),
    ("best_of_streamed", ok(best_of=2, stream=True), None, 400, "best_of", "stream"),
    ("suffix", ok(suffix="x"), None, 400, "suffix", "suffix"),
    ("unknown_field", ok(top_a=0.5), None, 400, "top_a", "top_a"),
    ("unknown_stream_option", ok(stream=True, stream_options={"continuous_usage_stats": True}),
     None, 400, "stream_options", "continuous_usage_stats"),
    ("presence_penalty_over_2", ok(presence_penalty=2.5), None, 400, "presence_penalty",
     "presence_penalty"),
    ("frequency_penalty_under_minus_2", ok(frequency_penalty=-3), None, 400,
     "frequency_penalty", "frequency_penalty"),
    ("repetition_penalty_zero", ok(repetition_penalty=0), None, 400, "repetition_penalty",
     "repetition_penalty"),
    ("logit_bias_key_not_an_id", ok(logit_bias={"a": 1}), None, 400, "logit_bias", "'a'"),
    ("logit_bias_id_outside_vocab", ok(logit_bias={"99999": 1}), None, 400, "logit_bias",
     "vocabulary"),
    ("logit_bias_over_100", ok(logit_bias={"5": 101}), None, 400, "logit_bias",
     "logit_bias"),
    ("stream_options_without_stream", ok(stream_options={"include_usage": True}), None, 400,
     "stream_options", "stream_options"),
    ("unknown_model", ok(model="gpt-4"), None, 404, "model", "gpt-4"),
    ("oversize_body", ok(prompt="x" * (MAX_BODY_BYTES + 1)), None, 413, "body",
     "max_body_bytes"),
    ("missing_api_key", ok(), {}, 401, "Authorization", "API key"),
    ("wrong_api_key", ok(), {"Authorization": "Bearer nope"}, 401, "Authorization", "API key"),
    ("wrong_auth_scheme", ok(), {"Authorization": f"Basic {API_KEY}"}, 401, "Authorization",
     "API key"),
]


@MODULE_LOOP
@pytest.mark.parametrize("payload,headers,status,param,needle",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_bad_request_gets_status_and_names_field(
        client: TestClient, payload: object, headers: dict[str, str] | None, status: int,
        param: str | None, needle: str) -> None:
    kwargs = {"data": payload} if isinstance(payload, bytes) else {"json": payload}
    headers = {**(AUTH if headers is None else headers), "Content-Type": "application/json"}
    resp = await client.post("/v1/completions", headers=headers,
                             **kwargs)  # type: ignore[arg-type]
    assert resp.status == status, await resp.text()
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and needle in error["message"], error
    assert error["type"] == "invalid_request_error"


@MODULE_LOOP
@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nothing", 404),
                                                ("GET", "/v1/completions", 405)])
async def test_unknown_route_or_method_is_an_openai_error(client: TestClient, method: str,
                                                          path: str, status: int) -> None:
    resp = await client.request(method, path, headers=AUTH)
    assert resp.status == status
    assert path in (await resp.json())["error"]["message"]


@MODULE_LOOP
@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/openapi.json", "/version"])
async def test_every_route_but_health_needs_the_api_key(client: TestClient, path: str) -> None:
    assert (await client.get(path)).status == 401
    assert (await client.get(path, headers=AUTH)).status == 200


@MODULE_LOOP
@pytest.mark.parametrize("path", ["/health", "/ping"])
async def test_liveness_probes_need_no_api_key(client: TestClient, path: str) -> None:
    assert (await client.get(path)).status == 200


JUNK: list[object] = [None, True, -1, 0, 1, 2.5, -1e308, 10**30, "", "x", "\u0000", [], [1],
                      [[1]], [""], ["a", [2, 3]], {}, {"include_usage": "yes"}]
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "ignore_eos", "min_tokens", "logprobs", "echo", "stream_options", "n", "best_of",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "stop_token_ids"]


@MODULE_LOOP
async def test_random_junk_fields_never_give_a_server_error(client: TestClient) -> None:
    rng = random.Random(0)
    seen = set()
    for _ in range(150):
        body = ok(max_tokens=1)
        for field in rng.sample(FIELDS, rng.randint(1, 3)):
            body[field] = rng.choice(JUNK)
        resp = await client.post("/v1/completions", json=body, headers=AUTH)
        seen.add(resp.status)
        assert resp.status in (200, 400, 404), (body, await resp.text())
        assert resp.status == 200 or "error" in await resp.json()
    assert {200, 400} <= seen


@MODULE_LOOP
async def test_server_stays_healthy_after_bad_requests(client: TestClient) -> None:
    assert (await client.get("/health")).status == 200
    resp = await client.post("/v1/completions", json=ok(), headers=AUTH)
    assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] >= 1
    client.server.app[ENGINE].check_integrity()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def strict_client() -> AsyncIterator[TestClient]:
    app = create_app(server_engine_config(max_waiting=1), ServerConfig())
    async with TestClient(TestServer(app)) as c:
        yield c


@MODULE_LOOP
async def test_over_the_waiting_limit_is_429_with_retry_after(strict_client: TestClient) -> None:
    engine = strict_client.server.app[ENGINE]
    gate = Gate(next(iter(engine.ctx.runners.values())), "execute")  # holds the prefill
    first = asyncio.create_task(strict_client.post("/v1/completions", json=ok(prompt="a")))
    await asyncio.wait_for(gate.entered.wait(), 10)
    second = asyncio.create_task(strict_client.post("/v1/completions", json=ok(prompt="b")))
    while engine.num_waiting < 1:  # the second waits: max_waiting (1) is reached
        await asyncio.sleep(0.005)
    resp = await strict_client.post("/v1/completions", json=ok(prompt=["a", "b"]))
    assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
    assert "max_waiting" in (await resp.json())["error"]["message"]
    gate.open()
    assert [r.status for r in await asyncio.gather(first, second)] == [200, 200]
    assert (await strict_client.post("/v1/completions", json=ok(prompt=["a", "b"]))).status == 200


@MODULE_LOOP
async def test_stopped_engine_is_unhealthy_and_refuses_work(strict_client: TestClient) -> None:
    await strict_client.server.app[ENGINE].stop()
    resp = await strict_client.get("/health")
    assert resp.status == 503 and (await resp.json())["status"] == "unhealthy"
    assert (await strict_client.post("/v1/completions", json=ok())).status == 503
