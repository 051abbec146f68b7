"""BatchRun: the requests of one HTTP request (prompts times `n` samples) running in the
engine, their outputs merged into one stream. Used by the handlers in aserve/server.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from aserve.core import Request, RequestOutput, SamplingParams
from aserve.engine import Engine
from aserve.metrics import ServerMetrics
from aserve.protocol import (
    ChoiceBuilder,
    CompletionRequest,
    RequestError,
    Usage,
    prompts_of,
    sampling_params,
)


class BatchRun:
    """The prompts of one HTTP request (each with its `n` samples), running concurrently in
    the engine; their outputs are merged into one stream of `(index, cumulative output)` in
    arrival order, where `index` is the choice's: prompt * n + sample."""

    def __init__(self, engine: Engine, groups: list[list[Request]],
                 metrics: ServerMetrics) -> None:
        self.engine, self.metrics = engine, metrics
        self.requests = [r for group in groups for r in group]
        self.num_prompt_tokens = sum(len(group[0].prompt_token_ids) for group in groups)
        self.last: list[RequestOutput | None] = [None] * len(self.requests)
        self.num_unfinished = len(self.requests)
        self._pending: tuple[int, RequestOutput] | None = None
        self._queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for group in groups:
                streams.extend(engine.submit_samples(group))
        except Exception:
            for request in self.requests[:len(streams)]:
                engine.abort(request.request_id)
            raise
        self._tasks = [asyncio.create_task(self._pump(i, stream), name=r.request_id)
                       for i, (r, stream) in enumerate(zip(self.requests, streams))]

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((index, out))
        except Exception as exc:  # re-raised by next() in the handler, which maps it
            self._queue.put_nowait((index, exc))

    @property
    def usage(self) -> Usage:
        """Token counts so far: each prompt once (whatever n is), every sample's output."""
        completion = sum(len(o.token_ids) for o in self.last if o is not None)
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                     total_tokens=self.num_prompt_tokens + completion)

    async def next(self) -> tuple[int, RequestOutput]:
        index, item = await self._queue.get()
        if isinstance(item, ValueError):
            raise RequestError(str(item), "prompt") from item
        if isinstance(item, Exception):
            raise item
        self.last[index] = item
        if item.finished:
            self.num_unfinished -= 1
            self.metrics.observe_finished(item)
        return index, item

    async def start(self) -> None:
        """Waits for the first output, so that submit errors (overload) surface before the
        handler sends any header."""
        self._pending = await self.next()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if self._pending is not None:
            item, self._pending = self._pending, None
            yield item
        while self.num_unfinished:
            yield await self.next()

    async def wait_all(self) -> list[RequestOutput]:
        async for _ in self.outputs():
            pass
        return [out for out in self.last if out is not None]

    def abort(self) -> None:
        for request, out in zip(self.requests, self.last):
            if out is None or not out.finished:
                self.engine.abort(request.request_id)

    async def close(self) -> None:
        """Cancels what still runs (generate() then aborts it in the engine) and counts it."""
        for task in self._tasks:
            task.cancel()
        await asyncio.wait(self._tasks)
        for request, out in zip(self.requests, self.last):
            if out is None or not out.finished:
                self.metrics.observe_aborted(len(request.prompt_token_ids),
                                             0 if out is None else len(out.token_ids))


def admit(engine: Engine, req: CompletionRequest, cmpl_id: str) -> list[list[Request]]:
    """Validates every prompt against the engine before anything is submitted; returns
    each prompt's `best_of` (default `n`) requests, sample i seeded with seed + i (as vLLM).
    Ranking samples (best_of > n) needs their logprobs, so they are always recorded then."""
    prompts = [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts_of(req)]
    num_samples = num_samples_of(req)
    max_waiting = engine.config.scheduler.max_waiting
    if engine.num_waiting + len(prompts) * num_samples > max_waiting:
        raise RequestError(f"server overloaded: {engine.num_waiting} requests waiting "
                           f"(max_waiting={max_waiting}); retry later", None, 503, "overloaded")
    groups = []
    for i, prompt in enumerate(prompts):
        max_tokens = req.max_tokens or max(engine.max_seq_len - len(prompt), 1)
        params = sampling_params(req, max_tokens)
        if num_samples > req.n:
            params = msgspec.structs.replace(params, logprobs=True)
        try:
            groups.append([engine.make_request(prompt, sample_params(params, j),
                                               f"{cmpl_id}-{i}-{j}") for j in range(num_samples)])
        except ValueError as exc:
            param = next((f for f in ("logit_bias", "max_tokens") if f in str(exc)), "prompt")
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise RequestError(f"{where}{exc}", param) from exc
    return groups


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None or index == 0:
        return params
    return msgspec.structs.replace(params, seed=params.seed + index)


def num_samples_of(req: CompletionRequest) -> int:
    """Samples generated per prompt: `best_of` when given, else `n`."""
    return req.best_of or req.n


def best_samples(req: CompletionRequest, outs: list[RequestOutput]) -> list[int]:
    """Indices into `outs` of the choices to return, in choice order: per prompt, the `n`
    of its `best_of` samples with the highest mean logprob per token (OpenAI's rule); all
    samples when best_of is not above n."""
    num_samples = num_samples_of(req)
    if num_samples == req.n:
        return list(range(len(outs)))
    chosen = []
    for start in range(0, len(outs), num_samples):
        group = range(start, start + num_samples)
        score = {i: sum(outs[i].logprobs or ()) / max(len(outs[i].token_ids), 1) for i in group}
        chosen.extend(sorted(group, key=lambda i: -score[i])[:req.n])
    return chosen


def choice_builders(req: CompletionRequest, run: BatchRun,
                    kept: list[int] | None = None) -> list[ChoiceBuilder]:
    """One per choice, for the requests `kept` (default all), indexed in that order; with
    `echo` each starts with its prompt (as sent, or decoded ids)."""
    prompts = prompts_of(req)
    tokenizer = run.engine.tokenizer
    echoes = [(p if isinstance(p, str) else tokenizer.decode(p)) if req.echo else None
              for p in prompts]
    num_samples = num_samples_of(req)
    kept = list(range(len(run.requests))) if kept is None else kept
    return [ChoiceBuilder(index, tokenizer, req.logprobs is not None,
                          echoes[i // num_samples]) for index, i in enumerate(kept)]
