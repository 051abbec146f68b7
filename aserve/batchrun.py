"""BatchRun: the prompts of one HTTP request running in the engine, admitted in a fair
share and merged into one stream of outputs. No aiohttp here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aserve.core import Request, RequestOutput
from aserve.engine import Engine
from aserve.metrics import ServerMetrics
from aserve.protocol import RequestError


class BatchRun:
    """The prompts of one HTTP request, running concurrently in the engine; their outputs
    are merged into one stream of `(index, cumulative output)` in arrival order.

    Fair share: prompts enter the engine in slices of at most one prefill step's tokens
    (`max_prefill_tokens`); the next slice enters once the last one is prefilled and a
    quarter of the run's decode share (`max_batch_size` unfinished prompts) is free. A request
    with thousands of prompts thus delays another by about one prefill step, not all of them.
    """

    def __init__(self, engine: Engine, requests: list[Request], metrics: ServerMetrics) -> None:
        self.engine, self.requests, self.metrics = engine, requests, metrics
        self.last: list[RequestOutput | None] = [None] * len(requests)
        self.num_unfinished = len(requests)
        self.is_aborted = False
        sched = engine.config.scheduler
        self.max_queued_tokens, self.max_live = sched.max_prefill_tokens, sched.max_batch_size
        self.min_slice = max(1, self.max_live // 4)  # prompts; fewer free: wait for more
        self._queued: set[int] = set()  # submitted, no output yet (waiting for prefill)
        self._num_live = 0  # submitted and unfinished
        self._pending: tuple[int, RequestOutput] | None = None
        self._queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._admit()

    def _admit(self) -> None:
        """Submits the next slice once the last one is prefilled and there is room for it."""
        if self._queued or self.is_aborted or self._num_live > self.max_live - self.min_slice:
            return
        budget = self.max_queued_tokens
        while len(self._tasks) < len(self.requests) and self._num_live < self.max_live:
            index = len(self._tasks)
            request = self.requests[index]
            num_tokens = len(request.prompt_token_ids)
            if self._queued and num_tokens > budget:
                return
            budget -= num_tokens
            self._queued.add(index)
            self._num_live += 1
            self._tasks.append(asyncio.create_task(self._pump(index, request),
                                                   name=request.request_id))

    async def _pump(self, index: int, request: Request) -> None:
        try:  # only a request's first prompt may be refused for overload (max_waiting)
            async for out in self.engine.generate(list(request.prompt_token_ids),
                                                  request.sampling, request.request_id,
                                                  is_admitted=index > 0):
                self._queue.put_nowait((index, out))
        except Exception as exc:  # re-raised by next() in the handler, which maps it
            self._queue.put_nowait((index, exc))

    async def next(self) -> tuple[int, RequestOutput]:
        index, item = await self._queue.get()
        if isinstance(item, ValueError):
            raise RequestError(str(item), "prompt") from item
        if isinstance(item, Exception):
            raise item
        self.last[index] = item
        self._queued.discard(index)
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
        self.num_unfinished -= len(self.requests) - len(self._tasks)
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
