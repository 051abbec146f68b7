"""The request bodies real clients send to /v1/completions: each field is honoured with its
documented effect (or is a 400 naming it, see test_server_errors.py). Real opt-tiny engine
behind aiohttp's test client; the byte tokenizer makes token effects readable in the text
(token id b + 4 is byte b)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from aserve import SamplingParams
from aserve.engine.config import ServerConfig
from aserve.engine.sequence import RequestOutput
from aserve.entrypoints.server import ENGINE, create_app
from tests.aserve.conftest import MODEL, server_engine_config

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")
MAX_SEQ_LEN = 8 * 16  # tokens: the KV stores below hold 8 blocks of 16
PROMPT = "Hello there"
NUM_PROMPT_TOKENS = len(PROMPT) + 1  # bytes plus BOS
A_ID = ord("a") + 4  # the byte tokenizer's id of "a"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client() -> AsyncIterator[TestClient]:
    config = server_engine_config(num_decode_blocks=8, num_prefill_blocks=8,
                                  num_staging_blocks=8, policy="aligned", min_requests=1)
    async with TestClient(TestServer(create_app(config, ServerConfig()))) as c:
        yield c


async def complete(client: TestClient, **fields: object) -> dict:  # type: ignore[type-arg]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, **fields}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()  # type: ignore[no-any-return]


async def engine_output(client: TestClient, **params: object) -> RequestOutput:
    """What the engine itself generates for PROMPT (its tokens are checked against
    transformers' processors in test_penalties.py)."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **params)
    return await client.server.app[ENGINE].complete(PROMPT, params)  # type: ignore[no-any-return]


PENALTIES = [
    ({"presence_penalty": 0.5}, {"presence_penalty": 2.0}),
    ({"frequency_penalty": 0.5}, {"frequency_penalty": 2.0}),
    ({"repetition_penalty": 1.1}, {"repetition_penalty": 5.0}),
]


@MODULE_LOOP
@pytest.mark.parametrize("small,large", PENALTIES, ids=lambda d: "_".join(map(str, d.items())))
async def test_penalty_fields_are_applied(client: TestClient, small: dict[str, float],
                                          large: dict[str, float]) -> None:
    for fields in (small, large):
        text = (await complete(client, **fields))["choices"][0]["text"]
        assert text == (await engine_output(client, **fields)).text
    neutral = (await complete(client))["choices"][0]["text"]
    assert (await complete(client, **large))["choices"][0]["text"] != neutral


@MODULE_LOOP
async def test_logit_bias_forces_and_bans_tokens(client: TestClient) -> None:
    forced = await complete(client, logit_bias={str(A_ID): 100})
    assert forced["choices"][0]["text"] == "a" * 12
    neutral = (await engine_output(client)).token_ids
    banned = await engine_output(client, logit_bias=tuple((t, -100.0) for t in set(neutral)))
    assert not set(banned.token_ids) & set(neutral)
    body = {str(t): -100 for t in set(neutral)}
    assert (await complete(client, logit_bias=body))["choices"][0]["text"] == banned.text


@MODULE_LOOP
async def test_stop_token_ids_end_the_completion(client: TestClient) -> None:
    out = await complete(client, logit_bias={str(A_ID): 100}, stop_token_ids=[A_ID],
                         ignore_eos=False)
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 1


@MODULE_LOOP
async def test_max_tokens_null_generates_up_to_the_context(client: TestClient) -> None:
    out = await complete(client, max_tokens=None)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == NUM_PROMPT_TOKENS
    assert out["usage"]["completion_tokens"] == MAX_SEQ_LEN - NUM_PROMPT_TOKENS


@MODULE_LOOP
async def test_echo_prepends_the_prompt(client: TestClient) -> None:
    plain = (await complete(client))["choices"][0]["text"]
    echoed = await complete(client, echo=True)
    assert echoed["choices"][0]["text"] == PROMPT + plain
    ids = await complete(client, prompt=[2, *[ord(c) + 4 for c in "Hi"]], echo=True)
    assert ids["choices"][0]["text"].startswith("Hi")


@MODULE_LOOP
@pytest.mark.parametrize("fields", [{}, {"best_of": 4}], ids=["n", "n_and_best_of"])
async def test_n_returns_indexed_seeded_reproducible_choices(
        client: TestClient, fields: dict[str, int]) -> None:
    body = dict(n=4, temperature=1.0, seed=7, prompt=["one", "two"], **fields)
    first, again = await complete(client, **body), await complete(client, **body)
    assert [c["index"] for c in first["choices"]] == list(range(8))
    assert first["choices"] == again["choices"]
    texts = [c["text"] for c in first["choices"]]
    assert len(set(texts[:4])) > 1, "the samples of one prompt are independent"
    # sample i of a seeded request is the request seeded with seed + i (as vLLM)
    single = await complete(client, temperature=1.0, seed=9, prompt="two")
    assert single["choices"][0]["text"] == texts[6]
    assert first["usage"]["prompt_tokens"] == 2 * 4  # each prompt once ("one"/"two" + BOS)
    assert first["usage"]["completion_tokens"] == 8 * 12


@MODULE_LOOP
async def test_langchain_default_body_is_accepted(client: TestClient) -> None:
    """LangChain's OpenAI wrapper sends neutral values of these fields by default."""
    out = await complete(client, temperature=0.7, top_p=1, frequency_penalty=0,
                         presence_penalty=0, n=1, logit_bias={}, seed=None, logprobs=None,
                         best_of=1, user="u1", stream_options=None)
    assert len(out["choices"]) == 1


@MODULE_LOOP
@pytest.mark.parametrize("add_special_tokens", [True, False])
async def test_tokenize_and_detokenize_round_trip(client: TestClient,
                                                  add_special_tokens: bool) -> None:
    resp = await client.post("/v1/tokenize", json={"model": MODEL, "prompt": "héllo",
                                                   "add_special_tokens": add_special_tokens})
    assert resp.status == 200, await resp.text()
    out = await resp.json()
    body = [b + 4 for b in "héllo".encode()]
    assert out["tokens"] == ([2] if add_special_tokens else []) + body
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_SEQ_LEN
    resp = await client.post("/v1/detokenize", json={"model": MODEL, "tokens": out["tokens"]})
    assert (await resp.json()) == {"prompt": "héllo"}


@MODULE_LOOP
@pytest.mark.parametrize("path,body,param", [
    ("/v1/tokenize", {"prompt": "x", "extra": 1}, "extra"),
    ("/v1/tokenize", {"model": "gpt-4", "prompt": "x"}, "model"),
    ("/v1/tokenize", {"messages": [{"role": "user", "content": "x"}]}, "messages"),
    ("/v1/detokenize", {"tokens": [99999]}, "tokens"),
])
async def test_tokenize_errors_name_the_field(client: TestClient, path: str,
                                              body: dict[str, object], param: str) -> None:
    resp = await client.post(path, json=body)
    assert resp.status in (400, 404)
    assert (await resp.json())["error"]["param"] == param


@MODULE_LOOP
async def test_version_and_ping(client: TestClient) -> None:
    version = await (await client.get("/version")).json()
    assert isinstance(version["version"], str) and version["version"]
    for method in ("GET", "POST"):
        resp = await client.request(method, "/ping")
        assert resp.status == 200 and (await resp.json())["status"] == "ok"


@MODULE_LOOP
@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_logprobs_covers_prompt_and_completion(client: TestClient,
                                                               stream: bool) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "echo": True, "logprobs": 0, "stream": stream}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    if stream:
        chunks = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                  if line.startswith("data: {")]
        choices = [c["choices"][0] for c in chunks]
        text = "".join(c["text"] for c in choices)
        logprobs = {k: sum((c["logprobs"][k] for c in choices), []) for k in
                    ("tokens", "token_logprobs", "text_offset")}
    else:
        choice = (await resp.json())["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
    engine_out = await client.server.app[ENGINE].complete(
        PROMPT, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=True,
                               prompt_logprobs=True))
    assert text == PROMPT + engine_out.text
    assert logprobs["tokens"][0] == ""  # BOS decodes to nothing
    assert "".join(logprobs["tokens"]) == text
    assert logprobs["token_logprobs"] == [None, *engine_out.prompt_logprobs,
                                          *engine_out.logprobs]
    assert logprobs["text_offset"] == [sum(len(t) for t in logprobs["tokens"][:i])
                                       for i in range(len(logprobs["tokens"]))]


@MODULE_LOOP
async def test_best_of_returns_the_n_most_likely_samples(client: TestClient) -> None:
    body = dict(temperature=1.0, seed=3, max_tokens=6)
    everything = (await complete(client, n=4, logprobs=0, **body))["choices"]
    mean = [sum(c["logprobs"]["token_logprobs"]) / 6 for c in everything]
    best = sorted(range(4), key=lambda i: -mean[i])[:2]
    out = await complete(client, n=2, best_of=4, **body)
    assert [c["text"] for c in out["choices"]] == [everything[i]["text"] for i in best]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 4 * 6  # every sample generated counts


@MODULE_LOOP
async def test_openapi_describes_the_new_routes(client: TestClient) -> None:
    doc = await (await client.get("/openapi.json")).json()
    for path in ("/v1/chat/completions", "/v1/tokenize", "/v1/detokenize", "/version", "/ping"):
        assert path in doc["paths"]
    schemas = doc["components"]["schemas"]
    assert {"messages", "max_completion_tokens", "logprobs"} <= set(
        schemas["ChatCompletionRequest"]["properties"])
    assert {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "n",
            "best_of", "echo"} <= set(schemas["CompletionRequest"]["properties"])
