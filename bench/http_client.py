"""Client mode: benchmarks any OpenAI-compatible server by URL with a workload's requests
(streamed `POST /v1/completions`, token-id prompts, `ignore_eos`, forced `max_tokens`).

Lifecycle events come from chunk arrival times on the client, so bench.metrics reads them
exactly like the engine's. Nothing in the package imports this.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import aiohttp

from aserve.engine.sequence import Event
from bench.harness import OnFinish, RunResult, replay
from bench.workloads import Workload, WorkloadRequest

DATA_PREFIX = b"data: "  # server-sent event line prefix
DONE = b"[DONE]"
REQUEST_TIMEOUT_S = 3600.0  # a whole streamed completion (slow CPU runs are long)


class CompletionError(RuntimeError):
    """The server answered a benchmark request with an error or a wrong output length."""


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model id the server lists at `GET /v1/models`."""
    async with session.get(f"{url}/v1/models") as resp:
        body = await resp.json()
        if resp.status != 200 or not body.get("data"):
            raise CompletionError(f"GET {url}/v1/models answered {resp.status}: {body}")
        return str(body["data"][0]["id"])


async def run_http(url: str, workload: Workload, prompts: Sequence[list[int]],
                   realtime: bool = True, model: str | None = None,
                   api_key: str | None = None, system: str = "http",
                   on_finish: OnFinish | None = None) -> RunResult:
    """Replays the workload against the server at `url` (e.g. http://127.0.0.1:8000).

    Each request asks for exactly its output length, greedy, EOS ignored, streamed, with
    the chosen-token logprobs so that every chunk says how many tokens it carries.
    """
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap on concurrency
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=timeout) as session:
        name = model or await served_model(session, url)
        start = time.perf_counter()
        per_request = await replay(workload, prompts, realtime, lambda req, ids: _one(
            session, url, name, req, ids, on_finish))
    wall_time = time.perf_counter() - start
    events = [e for evs in per_request for e in evs]
    token_ids: dict[str, list[int]] = {r.request_id: [] for r in workload.requests}
    return RunResult(system, events, [], token_ids, wall_time)


def completion_body(model: str, req: WorkloadRequest, prompt: list[int]) -> dict[str, object]:
    """The request body: token ids in, exactly `output_len` greedy tokens out, streamed."""
    return {"model": model, "prompt": prompt, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "logprobs": 1}


async def _one(session: aiohttp.ClientSession, url: str, model: str, req: WorkloadRequest,
               prompt: list[int], on_finish: OnFinish | None) -> list[Event]:
    seq_id = req.request_id
    events = [Event(seq_id, "arrival", time.perf_counter())]
    num_tokens, finish_reason = 0, None
    async with session.post(f"{url}/v1/completions",
                            json=completion_body(model, req, prompt)) as resp:
        if resp.status != 200:
            raise CompletionError(f"{seq_id}: HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            payload = _payload(line)
            if payload is None:
                continue
            if payload == DONE:
                break
            at = time.perf_counter()
            choice = json.loads(payload)["choices"][0]
            count = chunk_token_count(choice)
            for _ in range(count):
                events.append(Event(seq_id, "first_token" if num_tokens == 0 else "token", at))
                num_tokens += 1
            finish_reason = choice.get("finish_reason") or finish_reason
    events.append(Event(seq_id, "finish", time.perf_counter()))
    _check(seq_id, num_tokens, req.output_len, finish_reason)
    if on_finish is not None:
        on_finish()
    return events


def _payload(line: bytes) -> bytes | None:
    line = line.strip()
    return line[len(DATA_PREFIX):].strip() if line.startswith(DATA_PREFIX) else None


def chunk_token_count(choice: dict[str, object]) -> int:
    """Tokens a streamed choice carries: its logprobs' token list, or 1 for a chunk with
    text when the server sends no logprobs."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    return 1 if choice.get("text") else 0


def _check(seq_id: str, num_tokens: int, expected: int, finish_reason: str | None) -> None:
    if finish_reason != "length" or num_tokens != expected:
        raise CompletionError(f"{seq_id}: got {num_tokens} tokens with finish_reason "
                              f"{finish_reason!r}; expected {expected} and 'length' "
                              f"(does the server honour ignore_eos?)")
