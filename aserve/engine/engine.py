"""Engine: builds the actors (aserve/engine/actors.py, the engine driver of aserve/cores),
admits requests, and streams their outputs. One request passes through these three files:
admitted and streamed here, carried out by the driver's actors, decided by the cores.

The embedded API: `async with Engine(config) as engine: async for out in engine.generate(...)`.
Policy lives in scheduler/, tensors in the runner and transport/; this file wires them.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import torch

from aserve.cores import Lifecycle
from aserve.engine.actors import Actor, EngineContext, KVSpace
from aserve.engine.config import EngineConfig
from aserve.engine.errors import EngineError, EngineOverloaded
from aserve.engine.host import tune_host_allocator
from aserve.engine.runner import ModelRunner
from aserve.engine.sequence import (
    IterationRecord,
    Request,
    RequestOutput,
    SamplingParams,
    SeqState,
    SeqStatus,
    StepOutput,
)
from aserve.engine.step_probe import EngineStepCost, cache_dir, probe
from models.loader import resolve_dtype
from models.registry import checkpoint_path
from models.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from scheduler import PolicyConfig, get_policy, tree_range
from transport.kv import KVGeometry

logger = logging.getLogger(__name__)
RunnerFactory = Callable[[Any, torch.device, int], ModelRunner]


class Engine:
    """One serving engine: prefill, batcher and decode actors over shared KV space."""

    def __init__(self, config: EngineConfig | None = None,
                 runner_factory: RunnerFactory | None = None) -> None:
        self.config = config or EngineConfig()
        self._runner_factory = runner_factory or ModelRunner  # a test's runner replaces it
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._live: dict[str, SeqState] = {}
        self._last_served = float("-inf")  # when a request last completed (`health`)
        self.ctx: EngineContext | None = None
        self.tokenizer: Tokenizer
        self.is_running = False
        self._bytes_per_block = 0  # of the KV geometry, once started
        # the start-up probe's timed decode steps (aserve/engine/step_probe.py `probe`): instance
        # "probe", written first in the benchmark's iteration logs
        self.probe_iterations: list[IterationRecord] = []

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Loads the model on every device (in worker threads) and starts the actors."""
        cfg = self.config
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        if any(torch.device(dev).type == "cpu" for dev in cfg.decode_devices):
            tune_host_allocator()
        # NOTE: as vLLM's `seed`: sampled requests without a seed of their own draw from the
        # global RNG, so a run repeats when its requests are batched the same way.
        torch.manual_seed(cfg.seed)
        model_config, runners = await self._open_devices()
        default_source = checkpoint_path(cfg.model.model)
        self.tokenizer = load_tokenizer(
            cfg.model.tokenizer or default_source,
            model_config.vocab_size, model_config.eos_token_id, model_config.bos_token_id)
        max_len = min(model_config.max_position_embeddings,  # a checkpoint capped by config
                      cfg.model.max_position_embeddings or model_config.max_position_embeddings)
        geometry = KVGeometry(model_config.num_layers, model_config.num_kv_heads,
                              model_config.head_dim, cfg.cache.block_size,
                              resolve_dtype(cfg.model.dtype))
        sched = cfg.scheduler
        policy = get_policy(sched.policy, PolicyConfig.of(
            sched, tree_range(model_config.max_position_embeddings)))
        kv = await self._open_kv(geometry, runners, policy.uses_pool)
        self._bytes_per_block = geometry.bytes_per_block
        self.ctx = EngineContext(cfg, kv, runners, policy,  # type: ignore[arg-type]
                                 Lifecycle(kv, model_config.eos_token_id,
                                           trace_limit=cfg.trace_limit),
                                 max_len)
        # the cost-aware policy's step model: the runner's own if it has one (a test's
        # cost-model runner), else scheduler/cost_model.py's fitted to a start-up probe of the
        # decode device (synthetic steps over chosen lengths and batch sizes, run whatever the
        # policy: they are also every iteration log's calibration rows, as vLLM's profile
        # run is run whatever the workload), or the fit cached for this machine and probe
        step_time = getattr(runners.get(cfg.decode_devices[0]), "step_time", None)
        if step_time is None:
            self.probe_iterations = await self._probe(max_len)
            step_time = EngineStepCost(
                model_config, cfg.model.attention, cfg.decode_devices[0],
                resolve_dtype(cfg.model.dtype).itemsize, self.probe_iterations, cache_dir())
        policy.step_time = step_time
        self.vocab_size = model_config.vocab_size
        self.ctx.life.on_finish = self._on_finish
        self.ctx.wiring.connect(self._driver(), self.ctx, cfg.decode_devices)
        self._tasks = [asyncio.create_task(a.run(), name=a.name) for a in self.actors]
        for task in self._tasks:
            task.add_done_callback(self._on_actor_exit)
        # NOTE: as vLLM after start-up: what is alive now (modules, weights' wrappers, the
        # tokenizer: ~350k objects) goes to the permanent generation, so a full collection
        # walks only the serving loop's own objects; each took ~0.13 s here, inside a forward
        gc.collect()
        gc.freeze()
        self.is_running = True

    # -- what a driver provides (the Ray driver, aserve/cluster, overrides these) ------------
    async def _open_devices(self) -> tuple[Any, dict[str, Any]]:
        """Loads the model on every device, each in its worker thread: (the model's
        config, the runners by device)."""
        cfg = self.config
        runners: dict[str, Any] = {}
        for dev in dict.fromkeys((*cfg.prefill_devices, *cfg.decode_devices)):
            runners[dev] = await asyncio.to_thread(
                self._runner_factory, cfg.model, torch.device(dev), cfg.cache.block_size)
        return next(iter(runners.values())).model_config, runners

    async def _open_kv(self, geometry: KVGeometry, runners: dict[str, Any],
                       uses_pool: bool) -> KVSpace:
        """Every KV store of the engine, with its tensors."""
        # NOTE: off the event loop: allocating (and pinning) a large host pool takes a while.
        # In the CPU device's thread where there is one: the stores' null blocks are zeroed
        # by OpenMP threads, and the runner keeps all OpenMP work in one thread (runner.py).
        executors = {dev: r.executor for dev, r in runners.items()}
        return await asyncio.get_running_loop().run_in_executor(
            executors.get("cpu"), KVSpace, self.config, geometry, executors)

    async def _probe(self, max_len: int) -> list[IterationRecord]:
        """The start-up probe's timed decode steps on the first decode device."""
        cfg, ctx = self.config, self._context
        runner = ctx.runners[cfg.decode_devices[0]]
        return await runner.call(  # type: ignore[attr-defined, no-any-return]
            probe, runner, ctx.kv["decode0"].tensor, cfg.cache.num_decode_blocks,
            cfg.cache.block_size, max_len, cfg.scheduler.max_batch_size)

    def _driver(self) -> Callable[..., Actor]:
        """What drives each core: `driver(core, device)`."""
        return partial(Actor, self._context)

    def _close_devices(self) -> None:
        """Stops the copy threads and the runners' worker threads."""
        ctx = self._context
        ctx.kv.copier.shutdown()
        for runner in ctx.runners.values():
            runner.shutdown()

    def _on_actor_exit(self, task: asyncio.Task[None]) -> None:
        """An actor's loop ended. Outside `stop()` it died: it is recorded for /health, and
        every request in flight ends with an error naming it (its stream would hang)."""
        if not self.is_running:
            return
        exc = asyncio.CancelledError() if task.cancelled() else task.exception()
        actor = next(a for a in self.actors if a.name == task.get_name())
        error = f"actor {actor.name} died: " + actor.record_error(
            exc or EngineError("its loop returned"))
        for seq in list(self._live.values()):  # NOTE: not freed: another actor may hold them
            self._context.life.finish(seq, SeqStatus.FINISHED_ERROR, error,
                                         at=time.perf_counter(), release=False)

    @property
    def actors(self) -> list[Actor]:
        return self._context.wiring.drivers  # type: ignore[return-value]

    @property
    def _context(self) -> EngineContext:
        if self.ctx is None:
            raise EngineError("the engine is not started; use `async with Engine(...)`")
        return self.ctx

    async def stop(self) -> None:
        """Aborts what is in flight, stops the actors and releases the worker threads."""
        if not self.is_running:
            return
        self.is_running = False
        for seq_id in list(self._live):
            self.abort(seq_id)
        await asyncio.sleep(0)
        for actor in self.actors:
            actor.stop()
        await asyncio.wait(self._tasks, timeout=30)
        for task in self._tasks:
            task.cancel()
        self._close_devices()
        gc.unfreeze()  # what this engine held can be collected again

    # -- requests ------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None) -> Request:
        """Tokenizes and validates a request; raises ValueError naming the bad field."""
        ctx = self._context
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) and prompt else prompt
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size),
                   None)
        ids = list(ids)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        bad = next((t for t, _ in params.logit_bias if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        total = len(ids) + params.max_tokens
        if total > ctx.max_model_len:  # NOTE: the message starts with the field to blame
            field = "prompt" if len(ids) >= ctx.max_model_len else "max_tokens"
            raise ValueError(f"{field}: prompt ({len(ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) = {total} exceeds the model's context "
                             f"({ctx.max_model_len})")
        ctx.kv.check_fits(total, ctx.policy.uses_pool, "prompt + max_tokens")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._live:
            raise ValueError(f"request_id {rid!r} is already in flight")
        return Request(request_id=rid, prompt_token_ids=tuple(ids), sampling=params,
                       arrival_time=time.perf_counter())

    @property
    def max_seq_len(self) -> int:
        """The most tokens (prompt + output) one request may hold: the model's context,
        or less when a KV store is smaller."""
        ctx = self._context
        blocks = min(ctx.kv.limits(ctx.policy.uses_pool).values())
        return min(ctx.max_model_len, blocks * ctx.kv.block_size)

    @property
    def num_waiting(self) -> int:
        """Requests submitted whose prefill has not started (counted from the sequences,
        over every instance)."""
        return sum(1 for seq in self._live.values() if seq.status == SeqStatus.WAITING)

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens of the requests whose prefill has not started (a prompt's samples
        share its prefill: counted once)."""
        waiting = [seq for seq in self._live.values() if seq.status == SeqStatus.WAITING]
        forks = {fork.seq_id for seq in waiting for fork in seq.forks}
        return sum(len(seq.request.prompt_token_ids) for seq in waiting
                   if seq.seq_id not in forks)

    def submit(self, request: Request, is_admitted: bool = False) -> asyncio.Queue[StepOutput]:
        """Hands a validated request to the engine; returns its output queue.

        `is_admitted`: the front end admitted it already (a later slice of a batch), so the
        `max_waiting` bound on new requests does not refuse it."""
        return self._submit([request], is_admitted)[0][1]

    def submit_samples(self, requests: list[Request],
                       is_admitted: bool = False) -> list[AsyncIterator[RequestOutput]]:
        """Submits independent samples of one prompt (`n > 1`) that share its prefill: the
        first request is prefilled, the others start from a copy of its KV. Returns their
        output streams (as `generate`'s), in order."""
        return [self._stream(seq, queue) for seq, queue in self._submit(requests, is_admitted)]

    def _submit(self, requests: list[Request], is_admitted: bool = False
                ) -> list[tuple[SeqState, asyncio.Queue[StepOutput]]]:
        ctx = self._context
        if not self.is_running:
            raise EngineError("the engine is stopped")
        if any(task.done() for task in self._tasks):
            raise EngineError("an engine actor has died; see /health")
        if not is_admitted and self.num_waiting >= self.config.scheduler.max_waiting:
            raise EngineOverloaded(f"{self.num_waiting} requests are waiting "
                                   f"(max_waiting={self.config.scheduler.max_waiting})")
        prompt = requests[0].prompt_token_ids
        assert all(r.prompt_token_ids == prompt for r in requests), "samples share one prompt"
        seqs = [SeqState.from_request(r) for r in requests]
        queues: list[asyncio.Queue[StepOutput]] = []
        for seq in seqs:
            queues.append(asyncio.Queue())
            ctx.life.queues[seq.seq_id] = queues[-1]
            self._live[seq.seq_id] = seq
            ctx.life.event(seq.seq_id, "arrival", seq.request.arrival_time)
        seqs[0].forks = seqs[1:]
        ctx.wiring.submit(seqs[0])
        return list(zip(seqs, queues))

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None,
                       is_admitted: bool = False) -> AsyncIterator[RequestOutput]:
        """Streams a request's output as tokens come; the last output has finished=True.

        Leaving the loop early (or a client disconnect) aborts the request."""
        request = self.make_request(prompt, params or SamplingParams(), request_id)
        async for out in self._stream(*self._submit([request], is_admitted)[0]):
            yield out

    async def _stream(self, seq: SeqState,
                      queue: asyncio.Queue[StepOutput]) -> AsyncIterator[RequestOutput]:
        """The outputs of a submitted sequence, from its queue (see `generate`)."""
        detok = IncrementalDetokenizer(self.tokenizer, seq.request.prompt_token_ids,
                                       seq.sampling.stop)
        finished = False
        try:
            while not finished:
                # NOTE: every step's tokens queued meanwhile go into one output: a consumer
                # that lags (a client not reading) gets fewer, larger outputs, each a copy
                # of the history, instead of one copy per token
                out = await queue.get()
                detok.feed(out.new_token_ids)
                while not (out.finished or detok.stopped or queue.empty()):
                    out = queue.get_nowait()
                    detok.feed(out.new_token_ids)
                finished = out.finished
                if detok.stopped and not finished:
                    self.finish_request(seq.seq_id, SeqStatus.FINISHED_STOPPED)
                    finished = True
                    yield _output(seq, detok, "stop", None)
                else:
                    reason = out.finish_reason if finished else None
                    if finished:
                        detok.finish()
                        reason = "stop" if detok.stopped else reason
                    yield _output(seq, detok, reason, out.error)
        finally:
            if not finished:
                self.abort(seq.seq_id)

    def _on_finish(self, seq: SeqState) -> None:
        self._live.pop(seq.seq_id, None)
        if seq.status in (SeqStatus.FINISHED_STOPPED, SeqStatus.FINISHED_LENGTH):
            self._last_served = self._context.clock()  # the engine serves: errors before are over

    async def complete(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> RequestOutput:
        """Runs one request to its end and returns its final output."""
        last = None
        async for last in self.generate(prompt, params, request_id):
            pass
        assert last is not None, "generate yields at least the final output"
        return last

    def abort(self, request_id: str) -> None:
        """Ends a request wherever it is; its blocks are freed by the actor that holds it."""
        self.finish_request(request_id, SeqStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: SeqStatus) -> None:
        ctx = self._context
        if request_id not in self._live or self._live[request_id].is_finished:
            return
        ctx.life.abort(request_id, status)
        ctx.wiring.reap(ctx.clock())

    # -- observability ---------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """Whether every actor's loop is alive and none is failing, and the last error each
        one caught. An actor fails from an error caught at its boundary until one of its
        steps goes through, a request completes, or it has been idle for ERROR_HOLD_S
        (`Actor.is_failing`)."""
        tasks = {t.get_name(): t for t in self._tasks}
        now = self._context.clock()
        actors = {a.name: {"alive": not tasks[a.name].done(),
                           "failing": a.is_failing(now, self._last_served),
                           "errors": a.num_errors, "last_error": a.last_error}
                  for a in self.actors}
        healthy = all(a["alive"] and not a["failing"] for a in actors.values())
        return {"healthy": self.is_running and healthy, "actors": actors}

    def error_counts(self) -> dict[tuple[str, str], int]:
        """Errors caught at the actors' boundaries so far, by (actor, exception type)."""
        return {(a.name, kind): n for a in self.actors for kind, n in a.errors_by_kind.items()}

    def stats(self) -> dict[str, Any]:
        ctx = self._context
        return {"running": sum(1 for s in self._live.values()
                               if s.status >= SeqStatus.PREFILLING and not s.is_finished),
                "waiting": self.num_waiting, "live": len(self._live), "kv": ctx.kv.usage(),
                "kv_touched_bytes": ctx.kv.blocks_touched() * self._bytes_per_block}

    @property
    def events(self) -> list:  # type: ignore[type-arg]
        return self._context.life.events

    @property
    def iterations(self) -> list:  # type: ignore[type-arg]
        """Iteration records kept (the oldest are dropped past `trace_limit`)."""
        return self._context.life.iterations

    @property
    def prefill_iterations(self) -> list:  # type: ignore[type-arg]
        """One record per packed prefill of a prefill instance (disaggregated policies;
        `continuous` mixes its prefill into `iterations`), oldest dropped past `trace_limit`."""
        return self._context.life.prefill_iterations

    @property
    def num_dropped_iterations(self) -> int:
        """How many iteration records were dropped: the absolute index of iterations[0]."""
        return self._context.life.num_dropped_iterations

    @property
    def transfers(self) -> list:  # type: ignore[type-arg]
        """Completed KV moves (TransferRecord), in completion order; the oldest are dropped
        past `trace_limit` (`num_transfers` counts them all)."""
        return self._context.kv.transfers

    @property
    def num_transfers(self) -> int:
        """Every completed KV move, those dropped from `transfers` included."""
        return self._context.kv.num_transfers

    def check_integrity(self) -> None:
        self._context.kv.check_integrity()


def _output(seq: SeqState, detok: IncrementalDetokenizer, reason: str | None,
            error: str | None) -> RequestOutput:
    return RequestOutput(
        request_id=seq.seq_id, prompt_token_ids=list(seq.request.prompt_token_ids),
        token_ids=seq.output_token_ids, text=detok.text, finished=reason is not None,
        finish_reason=reason,  # type: ignore[arg-type]
        logprobs=list(seq.output_logprobs) if seq.sampling.logprobs else None,
        prompt_logprobs=list(seq.prompt_logprobs) if seq.sampling.prompt_logprobs else None,
        arrival_time=seq.request.arrival_time,
        first_token_time=seq.token_times[0] if seq.token_times else None,
        token_times=list(seq.token_times), error=error)


def model_config_is_preset(model: str) -> bool:
    """Whether `model` is a random-weight preset (no checkpoint, byte-level tokenizer)."""
    return checkpoint_path(model) is None


__all__ = ["Engine"]
