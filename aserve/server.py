"""The OpenAI-compatible HTTP server: aiohttp app factory, handlers, streaming, `serve()`.

Handlers parse (aserve/protocol.py), submit to the engine, and stream or collect; they never
touch tensors or block tables. Metrics live in aserve/metrics.py.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from aserve.config import EngineConfig, ServerConfig
from aserve.core import Request, RequestOutput, SamplingParams
from aserve.engine import Engine
from aserve.errors import EngineError, EngineOverloaded
from aserve.metrics import ServerMetrics
from aserve.protocol import (
    ChoiceBuilder,
    Completion,
    CompletionRequest,
    RequestError,
    Usage,
    completion_id,
    decode_request,
    error_json,
    now,
    openapi_document,
    prompts_of,
    sampling_params,
)

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # seconds a client is told to wait after a 503
SHUTDOWN_TIMEOUT_S = 10.0  # seconds in-flight handlers get to end after SIGINT/SIGTERM
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ENGINE = web.AppKey("engine", Engine)
SERVER_CONFIG = web.AppKey("server_config", ServerConfig)
METRICS = web.AppKey("metrics", ServerMetrics)
MODEL_NAMES: web.AppKey[tuple[str, ...]] = web.AppKey("model_names")


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


RUNS: web.AppKey[set[BatchRun]] = web.AppKey("runs")  # in flight, aborted on shutdown


def create_app(engine_config: EngineConfig, server_config: ServerConfig,
               engine: Engine | None = None) -> web.Application:
    """The aiohttp application; the engine starts and stops with it (`cleanup_ctx`).

    An `engine` passed in that is already running is used but neither started nor stopped."""
    app = web.Application(client_max_size=server_config.max_body_bytes,
                          middlewares=[_error_middleware, _auth_middleware])
    app[ENGINE] = engine if engine is not None else Engine(engine_config)
    app[SERVER_CONFIG] = server_config
    app[METRICS] = ServerMetrics()
    model = app[ENGINE].config.model.model
    app[MODEL_NAMES] = tuple(dict.fromkeys((server_config.served_model_name or model, model)))
    app[RUNS] = set()
    app.cleanup_ctx.append(_engine_lifetime)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app


async def _engine_lifetime(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE]
    is_owned = not engine.is_running
    if is_owned:
        await engine.start()
    try:
        yield
    finally:
        abort_all(app)
        if is_owned:
            await engine.stop()


def abort_all(app: web.Application) -> None:
    """Aborts every request in flight; their streams end with finish_reason "abort"."""
    runs: set[BatchRun] = app[RUNS]
    for run in list(runs):
        run.abort()


# -- middlewares ---------------------------------------------------------------------------
def _error_response(status: int, message: str, param: str | None = None,
                    code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return web.Response(status=status, body=error_json(message, kind, param, code),
                        content_type="application/json", headers=headers)


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's envelope; a client's bad input is never a 500."""
    try:
        return await handler(request)
    except RequestError as exc:
        return _error_response(exc.status, exc.message, exc.param, exc.code)
    except web.HTTPRequestEntityTooLarge as exc:
        limit = request.app[SERVER_CONFIG].max_body_bytes
        return _error_response(413, f"request body exceeds max_body_bytes ({limit}): "
                               f"{exc.text}", "body", "body_too_large")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_response(exc.status, f"{exc.reason}: {request.method} {request.path}",
                               code=exc.reason.lower().replace(" ", "_"))
    except EngineError as exc:
        code = "overloaded" if isinstance(exc, EngineOverloaded) else "engine_unavailable"
        return _error_response(503, str(exc), code=code)
    except ConnectionResetError:  # the client left; completions() aborted its requests
        raise
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(500, "internal server error", code="internal_error")


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bearer API key on every route but /health, compared in constant time."""
    key = request.app[SERVER_CONFIG].api_key
    if key is None or request.path == "/health":
        return await handler(request)
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    given = token.strip().encode("utf-8", "surrogateescape")  # header bytes may be odd
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, key.encode()):
        raise RequestError("missing or wrong API key: send 'Authorization: Bearer <key>'",
                           param="Authorization", status=401, code="invalid_api_key")
    return await handler(request)


# -- /v1/completions -----------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions`: validate everything, submit, then stream or collect."""
    app = request.app
    req = decode_request(await request.read())
    names: tuple[str, ...] = app[MODEL_NAMES]
    if req.model not in names:
        raise RequestError(f"model {req.model!r} does not exist; served: {', '.join(names)}",
                           "model", 404, "model_not_found")
    cmpl_id = completion_id()
    groups = _admit(app[ENGINE], req, cmpl_id)
    run = BatchRun(app[ENGINE], groups, app[METRICS])
    app[RUNS].add(run)
    try:
        await run.start()
        if req.stream:
            return await _stream(request, req, run, cmpl_id)
        return await _collect(req, run, cmpl_id)
    finally:
        app[RUNS].discard(run)
        await run.close()


def _admit(engine: Engine, req: CompletionRequest, cmpl_id: str) -> list[list[Request]]:
    """Validates every prompt against the engine before anything is submitted; returns
    each prompt's `n` requests (sample i seeded with seed + i, as vLLM does)."""
    prompts = [engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts_of(req)]
    max_waiting = engine.config.scheduler.max_waiting
    if engine.num_waiting + len(prompts) * req.n > max_waiting:
        raise RequestError(f"server overloaded: {engine.num_waiting} requests waiting "
                           f"(max_waiting={max_waiting}); retry later", None, 503, "overloaded")
    groups = []
    for i, prompt in enumerate(prompts):
        max_tokens = req.max_tokens or max(engine.max_seq_len - len(prompt), 1)
        params = sampling_params(req, max_tokens)
        try:
            groups.append([engine.make_request(prompt, _sample_params(params, j),
                                               f"{cmpl_id}-{i}-{j}") for j in range(req.n)])
        except ValueError as exc:
            param = next((f for f in ("logit_bias", "max_tokens") if f in str(exc)), "prompt")
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise RequestError(f"{where}{exc}", param) from exc
    return groups


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None or index == 0:
        return params
    return msgspec.structs.replace(params, seed=params.seed + index)


def _usage(run: BatchRun) -> Usage:
    prompt = run.num_prompt_tokens  # once per prompt, whatever n is
    completion = sum(len(o.token_ids) for o in run.last if o is not None)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


async def _collect(req: CompletionRequest, run: BatchRun, cmpl_id: str) -> web.Response:
    outs = await run.wait_all()
    failed = [(i, out.error) for i, out in enumerate(outs) if out.finish_reason == "error"]
    if failed:
        return _error_response(500, f"the engine failed on prompt {failed[0][0]}: "
                               f"{failed[0][1]}", code="engine_error")
    choices = [builder.delta(out) for builder, out in zip(_builders(req, run), outs)]
    body = Completion(id=cmpl_id, created=now(), model=req.model, choices=choices,
                      usage=_usage(run))
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def _stream(request: web.Request, req: CompletionRequest, run: BatchRun,
                  cmpl_id: str) -> web.StreamResponse:
    """Server-sent events: one chunk per new text, `usage` if asked, then `[DONE]`.

    A client disconnect raises out of `write` (or cancels the handler); the caller's
    `finally` aborts the requests."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    builders = _builders(req, run)
    created = now()
    async for index, out in run.outputs():
        choice = builders[index].delta(out)
        if choice.text or choice.finish_reason or (choice.logprobs and choice.logprobs.tokens):
            chunk = Completion(id=cmpl_id, created=created, model=req.model, choices=[choice])
            await resp.write(_sse(msgspec.json.encode(chunk)))
    if req.stream_options is not None and req.stream_options.include_usage:
        chunk = Completion(id=cmpl_id, created=created, model=req.model, choices=[],
                           usage=_usage(run))
        await resp.write(_sse(msgspec.json.encode(chunk)))
    await resp.write(_sse(b"[DONE]"))
    await resp.write_eof()
    return resp


def _builders(req: CompletionRequest, run: BatchRun) -> list[ChoiceBuilder]:
    """One per choice; with `echo` each starts with its prompt (as sent, or decoded ids)."""
    prompts = prompts_of(req)
    tokenizer = run.engine.tokenizer
    echoes = [(p if isinstance(p, str) else tokenizer.decode(p)) if req.echo else ""
              for p in prompts]
    return [ChoiceBuilder(i, tokenizer, req.logprobs is not None, echoes[i // req.n])
            for i in range(len(run.requests))]


def _sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


# -- the other routes ----------------------------------------------------------------------
async def models(request: web.Request) -> web.Response:
    """`GET /v1/models`: the served model (and its underlying name, if different)."""
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "aserve"}
            for name in request.app[MODEL_NAMES]]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """`GET /health`: 200 while every actor is alive, else 503 (no API key needed)."""
    engine = request.app[ENGINE]
    report = engine.health() if engine.is_running else {"healthy": False, "actors": {}}
    status = 200 if report["healthy"] else 503
    return web.json_response({"status": "ok" if status == 200 else "unhealthy", **report},
                             status=status, dumps=lambda o: json.dumps(o, default=str))


async def metrics(request: web.Request) -> web.Response:
    """`GET /metrics`: the Prometheus text format of this app's registry."""
    engine, registry = request.app[ENGINE], request.app[METRICS]
    if engine.is_running:
        registry.update(engine.stats(), engine.iterations, engine.num_dropped_iterations)
    return web.Response(body=registry.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    """`GET /openapi.json`: generated from the msgspec request and response types."""
    try:
        version = importlib.metadata.version("aserve")
    except importlib.metadata.PackageNotFoundError:
        version = "0"
    return web.json_response(openapi_document("AlignedServe", version))


# -- the process ---------------------------------------------------------------------------
def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Runs the server on uvloop until SIGINT/SIGTERM; returns the exit status (0)."""
    try:
        import uvloop
    except ImportError:  # uvloop is not built for Windows
        return asyncio.run(run_server(engine_config, server_config))
    return uvloop.run(run_server(engine_config, server_config))


async def run_server(engine_config: EngineConfig, server_config: ServerConfig,
                     started: Callable[[int], None] | None = None) -> int:
    """Serves until SIGINT/SIGTERM: then stops accepting, aborts in-flight requests, stops
    the engine and returns 0. `started(port)` is called once the socket listens."""
    app = create_app(engine_config, server_config)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    site = web.TCPSite(runner, server_config.host, server_config.port)
    await site.start()
    port = runner.addresses[0][1]
    logger.info("serving %s on http://%s:%d", app[MODEL_NAMES][0], server_config.host, port)
    if started is not None:
        started(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        logger.info("shutting down: no new connections, aborting in-flight requests")
        await site.stop()
        abort_all(app)
    finally:
        await runner.cleanup()
    return 0
