"""A Prometheus scrape under load shows vLLM's metric names (labelled by model_name) with
values that move: requests running and KV in use while they run, counters and histograms
grown by exactly what the requests did once they finish; aserve_* series stay."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from aserve.engine.config import ServerConfig
from aserve.entrypoints.server import create_app
from tests.aserve.conftest import MODEL, parse_metrics, server_engine_config

NUM_REQUESTS = 8
MAX_TOKENS = 300
LABEL = f'{{model_name="{MODEL}"}}'


def vllm(name: str) -> str:
    return f"vllm:{name}{LABEL}"


async def scrape(client: TestClient) -> dict[str, float]:
    return parse_metrics(await (await client.get("/metrics")).text())


async def test_vllm_metrics_move_under_load() -> None:
    app = create_app(server_engine_config(), ServerConfig())
    async with TestClient(TestServer(app)) as client:
        before = await scrape(client)
        body = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "prompt": [2] * 20}
        tasks = [asyncio.ensure_future(client.post("/v1/completions", json=body))
                 for _ in range(NUM_REQUESTS)]
        during = []
        while not all(t.done() for t in tasks):  # scrape until every request is answered
            during.append(await scrape(client))
            await asyncio.sleep(0.01)
        assert [t.result().status for t in tasks] == [200] * NUM_REQUESTS
        after = await scrape(client)
    assert max(m[vllm("num_requests_running")] for m in during) > 0
    assert max(m[vllm("gpu_cache_usage_perc")] for m in during) > 0
    assert max(m[vllm("kv_cache_usage_perc")] for m in during) > 0
    assert all(0 <= m[vllm("gpu_cache_usage_perc")] <= 1 for m in during)
    assert after[vllm("num_requests_running")] == after[vllm("num_requests_waiting")] == 0
    assert after[vllm("gpu_cache_usage_perc")] == 0
    grown = {name: after[vllm(name)] - before[vllm(name)] for name in (
        "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
        "e2e_request_latency_seconds_count", "time_per_output_token_seconds_count")}
    assert grown == {"prompt_tokens_total": NUM_REQUESTS * 20,
                     "generation_tokens_total": NUM_REQUESTS * MAX_TOKENS,
                     "time_to_first_token_seconds_count": NUM_REQUESTS,
                     "e2e_request_latency_seconds_count": NUM_REQUESTS,
                     "time_per_output_token_seconds_count": NUM_REQUESTS * (MAX_TOKENS - 1)}
    success = f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'
    assert after[success] - before.get(success, 0) == NUM_REQUESTS
    assert after["aserve_generation_tokens_total"] == NUM_REQUESTS * MAX_TOKENS
