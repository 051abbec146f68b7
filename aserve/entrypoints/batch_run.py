"""BatchRun: the requests of one HTTP request (prompts times `n` samples) running in the
engine, admitted in a fair share and merged into one stream of outputs; `admit` validates
them first. Used by the handlers in aserve/entrypoints/server.py; no aiohttp here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from aserve.engine.config import ServerConfig
from aserve.engine.engine import Engine
from aserve.engine.sequence import Request, RequestOutput, SamplingParams
from aserve.entrypoints.metrics import ServerMetrics
from aserve.entrypoints.protocol import (
    ChoiceBuilder,
    CompletionRequest,
    RequestError,
    Usage,
    prompts_of,
    sampling_params,
)

PACE_STEPS = 32  # recent prefill steps whose pace estimates the waiting prompts' prefill


class BatchRun:
    """The prompts of one HTTP request (each with its `n` samples), running concurrently in
    the engine; their outputs are merged into one stream of `(index, cumulative output)` in
    arrival order, where `index` is the choice's: prompt * n + sample.

    Fair share: prompts enter the engine in slices of at most one prefill step's tokens
    (`max_prefill_tokens`); the next slice enters once the last one is prefilled and a
    quarter of the run's decode share (`max_batch_size` unfinished samples) is free. A request
    with thousands of prompts thus delays another by about one prefill step, not all of them.
    A prompt's samples enter together (they share its prefill).
    """

    def __init__(self, engine: Engine, groups: list[list[Request]],
                 metrics: ServerMetrics) -> None:
        self.engine, self.metrics, self.groups = engine, metrics, groups
        self.requests = [r for group in groups for r in group]
        self.num_prompt_tokens = sum(len(group[0].prompt_token_ids) for group in groups)
        self.last: list[RequestOutput | None] = [None] * len(self.requests)
        self.num_unfinished = len(self.requests)
        self.is_aborted = False
        sched = engine.config.scheduler
        self.max_queued_tokens, self.max_live = sched.max_prefill_tokens, sched.max_batch_size
        self.min_slice = max(1, self.max_live // 4)  # samples; fewer free: wait for more
        self._num_submitted = 0  # groups
        self._queued: set[int] = set()  # submitted groups with no output yet (prefilling)
        self._num_live = 0  # submitted and unfinished samples
        self._pending: tuple[int, RequestOutput] | None = None
        self._queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()
        # NOTE: outputs queued at once, bounded: while the handler takes none (its client
        # does not read) the pumps wait, and the engine's steps coalesce into one output per
        # sample (`Engine._stream`) instead of piling up here, each a copy of the history
        self._room = asyncio.Semaphore(2 * len(self.requests))
        self._tasks: list[asyncio.Task[None]] = []
        self._admit()

    def _admit(self) -> None:
        """Submits the next slice once the last one is prefilled and there is room for it."""
        if self._queued or self.is_aborted or self._num_live > self.max_live - self.min_slice:
            return
        budget = self.max_queued_tokens
        while self._num_submitted < len(self.groups) and self._num_live < self.max_live:
            g = self._num_submitted
            group = self.groups[g]
            num_tokens = len(group[0].prompt_token_ids)
            if self._queued and num_tokens > budget:
                return
            budget -= num_tokens
            self._num_submitted += 1
            self._queued.add(g)
            self._num_live += len(group)
            first = g * len(group)
            try:  # only a request's first prompt may be refused for overload (max_waiting)
                streams = self.engine.submit_samples(group, is_admitted=g > 0)
            except Exception as exc:  # re-raised by next() in the handler, which maps it
                for i in range(first, first + len(group)):
                    self._queue.put_nowait((i, exc))
                return
            self._tasks.extend(asyncio.create_task(self._pump(first + j, stream),
                                                   name=r.request_id)
                               for j, (r, stream) in enumerate(zip(group, streams)))

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await self._room.acquire()
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
        self._room.release()
        self.last[index] = item
        self._queued.discard(index // len(self.groups[0]))
        if item.finished:
            self.num_unfinished -= 1
            self._num_live -= 1
            self.metrics.observe_finished(item)
        self._admit()
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
        """Ends the run: what runs is aborted, what never entered the engine never will."""
        self.is_aborted = True
        self.num_unfinished -= sum(len(g) for g in self.groups[self._num_submitted:])
        for request, out in zip(self.requests, self.last):
            if out is None or not out.finished:
                self.engine.abort(request.request_id)

    async def close(self) -> None:
        """Counts what did not finish as aborted, then cancels it (generate() then aborts it
        in the engine). Counting comes first: the handler may itself be cancelled (a client
        disconnect) while it waits for the tasks."""
        for request, out in zip(self.requests, self.last):
            if out is None or not out.finished:
                self.metrics.observe_aborted(len(request.prompt_token_ids),
                                             0 if out is None else len(out.token_ids))
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)


def admit(engine: Engine, config: ServerConfig, req: CompletionRequest,
          cmpl_id: str) -> list[list[Request]]:
    """Validates every prompt against the engine and the per-request caps (400: it can
    never run) before anything is submitted; 429 while the engine is overloaded. Returns each
    prompt's `best_of` (default `n`) requests, sample i seeded with seed + i (as vLLM).
    Ranking samples (best_of > n) needs their logprobs, so they are always recorded then."""
    prompts = prompts_of(req)
    num_samples = num_samples_of(req)
    if len(prompts) * num_samples > config.max_request_prompts:
        raise RequestError(f"the request has {len(prompts)} prompts x {num_samples} samples, "
                           f"over max_request_prompts ({config.max_request_prompts}); split it",
                           "prompt", 400, "too_many_prompts")
    check_load(engine, config)
    groups = []
    for i, prompt in enumerate(prompts):
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        max_tokens = req.max_tokens or max(engine.max_seq_len - len(ids), 1)
        params = sampling_params(req, max_tokens)
        if num_samples > req.n:
            params = msgspec.structs.replace(params, logprobs=True)
        try:
            groups.append([engine.make_request(ids, sample_params(params, j),
                                               f"{cmpl_id}-{i}-{j}") for j in range(num_samples)])
        except ValueError as exc:
            param = next((f for f in ("logit_bias", "max_tokens", "prompt")
                          if str(exc).startswith(f)), "prompt")
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise RequestError(f"{where}{exc}", param) from exc
    total = sum(len(r.prompt_token_ids) + r.sampling.max_tokens for g in groups for r in g)
    if total > config.max_request_tokens:
        raise RequestError(f"the request's prompts + max_tokens come to {total} tokens, over "
                           f"max_request_tokens ({config.max_request_tokens}); split it",
                           "prompt", 400, "too_many_tokens")
    return groups


def check_load(engine: Engine, config: ServerConfig) -> None:
    """429 `overloaded` (as OpenAI answers an overloaded engine) while `max_waiting`
    requests wait for prefill, or while the waiting prompts need more than
    `max_prefill_backlog` seconds of it: offered more than it can prefill, a server would
    otherwise queue without end, each request waiting longer than the one before."""
    max_waiting = engine.config.scheduler.max_waiting
    if engine.num_waiting >= max_waiting:
        raise RequestError(f"server overloaded: {engine.num_waiting} requests waiting "
                           f"(max_waiting={max_waiting}); retry later", None, 429, "overloaded")
    backlog = prefill_backlog(engine) if config.max_prefill_backlog else None
    if backlog is not None and backlog > config.max_prefill_backlog:
        raise RequestError(f"server overloaded: the prompts waiting need about {backlog:.0f} s "
                           f"of prefill (max_prefill_backlog={config.max_prefill_backlog:g} "
                           "s); retry later", None, 429, "overloaded")


def prefill_backlog(engine: Engine) -> float | None:
    """Seconds of prefill the waiting prompts need, at the pace of the last PACE_STEPS
    prefill steps, or of a step still running if it is slower (at least its time so far per
    token: a cold server's first step, or one the CPU is starved for); each prefill
    instance takes its share. None before the first prefill step has begun."""
    steps = (engine.prefill_iterations[-PACE_STEPS:]
             or [r for r in engine.iterations[-PACE_STEPS:] if r.num_prefill_tokens])
    num_tokens = sum(r.num_prefill_tokens for r in steps)
    pace = sum(r.forward_time for r in steps) / num_tokens if num_tokens else 0.0  # s/token
    pace = max([pace, *filter(None, (a.running_prefill_pace() for a in engine.actors))])
    if not pace:
        return None
    return engine.num_waiting_tokens * pace / len(engine.config.prefill_devices)


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
