"""The OpenAI-compatible HTTP server: aiohttp app factory, handlers, streaming, `serve()`.

Handlers parse (protocol.py), submit to the engine, and stream or collect; they never touch
tensors or block tables. Metrics live in metrics.py.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from aserve.cluster import engine_for
from aserve.engine.config import EngineConfig, ServerConfig
from aserve.engine.engine import Engine
from aserve.engine.errors import EngineError, EngineOverloaded, is_retryable
from aserve.entrypoints import guard
from aserve.entrypoints.batch_run import BatchRun, admit, best_samples, choice_builders
from aserve.entrypoints.chat import (
    NO_TEMPLATE,
    ChatCompletionRequest,
    ChatFormat,
    ChatTemplate,
    TokenizeRequest,
    chat_id,
    decode_chat_request,
    load_chat_template,
)
from aserve.entrypoints.client_budget import ClientBudget
from aserve.entrypoints.loop_watch import LoopWatch
from aserve.entrypoints.metrics import ServerMetrics
from aserve.entrypoints.protocol import (
    CompletionFormat,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    clip,
    completion_id,
    decode_json,
    decode_request,
    error_json,
    now,
    openapi_document,
)
from models.registry import checkpoint_path

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # seconds a client is told to wait after a 503 or a 429
CLIENT_CLOSED = 499  # the access log's status of a request whose client left (as nginx's)
SHUTDOWN_TIMEOUT_S = 10.0  # seconds in-flight handlers get to end after SIGINT/SIGTERM
PUBLIC_PATHS = ("/health", "/ping")  # liveness probes need no API key
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ENGINE = web.AppKey("engine", Engine)
SERVER_CONFIG = web.AppKey("server_config", ServerConfig)
METRICS = web.AppKey("metrics", ServerMetrics)
MODEL_NAMES: web.AppKey[tuple[str, ...]] = web.AppKey("model_names")
CHAT_TEMPLATE: web.AppKey[ChatTemplate | None] = web.AppKey("chat_template")
ResponseFormat = CompletionFormat | ChatFormat


RUNS: web.AppKey[set[BatchRun]] = web.AppKey("runs")  # in flight, aborted on shutdown
BUDGET: web.AppKey[ClientBudget | None] = web.AppKey("budget")  # None: no budget, no share
LOOP_WATCH = web.AppKey("loop_watch", LoopWatch)


def create_app(engine_config: EngineConfig, server_config: ServerConfig,
               engine: Engine | None = None) -> web.Application:
    """The aiohttp application; the engine starts and stops with it (`cleanup_ctx`).

    An `engine` passed in that is already running is used but neither started nor stopped."""
    app = web.Application(client_max_size=server_config.max_body_bytes,
                          middlewares=[_error_middleware, guard.slot_middleware,
                                       guard.host_middleware, _auth_middleware,
                                       guard.body_middleware])
    app[ENGINE] = engine if engine is not None else engine_for(engine_config)
    app[SERVER_CONFIG] = server_config
    model = app[ENGINE].config.model.model
    app[MODEL_NAMES] = tuple(dict.fromkeys((server_config.served_model_name or model, model)))
    app[METRICS] = ServerMetrics(app[MODEL_NAMES][0])
    app[RUNS] = set()
    limit, window = server_config.max_client_tokens, server_config.fair_share_window
    cache = app[ENGINE].config.cache
    capacity = cache.num_decode_blocks * cache.block_size * len(app[ENGINE].config.decode_devices)
    app[BUDGET] = ClientBudget(limit, capacity, window) if limit or window else None
    app[LOOP_WATCH] = LoopWatch(app[METRICS].loop_lag.observe)
    app[CHAT_TEMPLATE] = load_chat_template(server_config.chat_template,
                                            _checkpoint_dir(engine_config.model.model))
    app.cleanup_ctx.append(_engine_lifetime)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/tokenize", tokenize)
    app.router.add_post("/v1/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/ping", ping)
    app.router.add_post("/ping", ping)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    guard.install(app, server_config)  # after every route: CORS covers them all
    return app


async def _engine_lifetime(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE]
    is_owned = not engine.is_running
    if is_owned:
        await engine.start()
    app[LOOP_WATCH].start()
    try:
        yield
    finally:
        abort_all(app)
        await app[LOOP_WATCH].stop()
        if is_owned:
            await engine.stop()


def abort_all(app: web.Application) -> None:
    """Aborts every request in flight; their streams end with finish_reason "abort"."""
    runs: set[BatchRun] = app[RUNS]
    for run in list(runs):
        run.abort()


class ClientLeft(ConnectionResetError):
    """A request's client left (or read nothing for `write_timeout`); logged and counted
    where it was found."""


# -- middlewares ---------------------------------------------------------------------------
def _error_response(status: int, message: str, param: str | None = None,
                    code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return web.Response(status=status, body=error_json(message, kind, param, code),
                        content_type="application/json", headers=headers)


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's envelope; a client's bad input is never a 500."""
    try:
        return await handler(request)
    except RequestError as exc:
        if exc.code == "overloaded":
            request.app[METRICS].overload_refusals.inc()
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
    except EngineOverloaded as exc:  # as OpenAI answers an overloaded engine: retry later
        request.app[METRICS].overload_refusals.inc()
        return _error_response(429, str(exc), code="overloaded")
    except EngineError as exc:
        return _error_response(503, str(exc), code="engine_unavailable")
    except ConnectionResetError as exc:  # the client left (its requests are aborted)
        if not isinstance(exc, ClientLeft):  # before its body was read
            request.app[METRICS].disconnects.inc()
            logger.info("%s %s: the client disconnected before its request was read",
                        request.method, request.path)
        return web.Response(status=CLIENT_CLOSED)  # NOTE: for the access log; nobody reads it
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(500, "internal server error", code="internal_error")


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bearer API key on every route but PUBLIC_PATHS, compared in constant time."""
    key = request.app[SERVER_CONFIG].api_key
    if key is None or request.path in PUBLIC_PATHS or request.method == "OPTIONS":
        return await handler(request)  # a CORS preflight carries no credentials
    if not _has_key(request, key):
        raise RequestError("missing or wrong API key: send 'Authorization: Bearer <key>'",
                           param="Authorization", status=401, code="invalid_api_key")
    return await handler(request)


def _has_key(request: web.Request, key: str) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    given = token.strip().encode("utf-8", "surrogateescape")  # header bytes may be odd
    return scheme.lower() == "bearer" and hmac.compare_digest(given, key.encode())


# -- /v1/completions and /v1/chat/completions ----------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions`: validate everything, submit, then stream or collect."""
    req = decode_request(await request.read())
    _check_model(request.app, req.model)
    return await _serve(request, req, completion_id(), CompletionFormat())


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/chat/completions`: render the messages with the chat template, then serve
    the prompt's completion in the chat shape."""
    chat = decode_chat_request(await request.read())
    _check_model(request.app, chat.model)
    template = request.app[CHAT_TEMPLATE]
    if template is None:
        raise RequestError(NO_TEMPLATE.format(model=chat.model), "messages", 400,
                           "chat_template_missing")
    prompt = _chat_prompt(request.app[ENGINE], template.render(
        chat.messages, chat.add_generation_prompt))
    return await _serve(request, chat.to_completion(prompt), chat_id(), ChatFormat())


def _chat_prompt(engine: Engine, text: str) -> list[int]:
    """The rendered chat's ids without added special tokens (as transformers tokenizes it:
    the template writes the special tokens it wants)."""
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _check_model(app: web.Application, model: str) -> None:
    names: tuple[str, ...] = app[MODEL_NAMES]
    if model not in names:
        raise RequestError(f"model {clip(model)!r} does not exist; served: {', '.join(names)}",
                           "model", 404, "model_not_found")


async def _serve(request: web.Request, req: CompletionRequest, cmpl_id: str,
                 fmt: ResponseFormat) -> web.StreamResponse:
    app = request.app
    groups = admit(app[ENGINE], app[SERVER_CONFIG], req, cmpl_id)
    budget, client = app[BUDGET], request.remote or "unknown"
    num_tokens = sum(len(r.prompt_token_ids) + r.sampling.max_tokens for g in groups for r in g)
    if budget is not None:
        try:
            budget.take(client, num_tokens, asyncio.get_running_loop().time())
        except RequestError:
            app[METRICS].client_refusals.inc()
            raise
    run = BatchRun(app[ENGINE], groups, app[METRICS])
    app[RUNS].add(run)
    try:
        await run.start()
        if req.stream:
            return await _stream(request, req, run, cmpl_id, fmt)
        return await _collect(req, run, cmpl_id, fmt)
    except (asyncio.CancelledError, ConnectionResetError) as exc:  # the client left
        if not isinstance(exc, ClientLeft):
            app[METRICS].disconnects.inc()
            logger.info("request %s: the client disconnected; its requests are aborted",
                        cmpl_id)
        if isinstance(exc, ConnectionResetError):
            raise ClientLeft(cmpl_id) from None
        raise
    finally:
        app[RUNS].discard(run)
        if budget is not None:
            budget.give_back(client, num_tokens)
        await run.close()


async def _collect(req: CompletionRequest, run: BatchRun, cmpl_id: str,
                   fmt: ResponseFormat) -> web.Response:
    outs = await run.wait_all()
    if run.is_aborted:  # the server is shutting down: the client should retry, not trust this
        return _error_response(503, "the server shut down before the completion finished; "
                               "retry", code="shutting_down")
    failed = [(i, out.error) for i, out in enumerate(outs) if out.finish_reason == "error"]
    if failed and all(is_retryable(error) for _, error in failed):  # a lost node: retry
        return _error_response(503, f"prompt {failed[0][0]}: {failed[0][1]}; retry",
                               code="node_lost")
    if failed:
        return _error_response(500, f"the engine failed on prompt {failed[0][0]}: "
                               f"{failed[0][1]}", code="engine_error")
    kept = best_samples(req, outs)
    builders = choice_builders(req, run, kept)
    choices = [builder.delta(outs[i]) for builder, i in zip(builders, kept)]
    body = fmt.body(cmpl_id, now(), req.model, choices, run.usage)
    return web.Response(body=body, content_type="application/json")


async def _stream(request: web.Request, req: CompletionRequest, run: BatchRun,
                  cmpl_id: str, fmt: ResponseFormat) -> web.StreamResponse:
    """Server-sent events: one chunk per new text, `usage` if asked, then `[DONE]`.

    A client disconnect raises out of `write` (or cancels the handler); the caller's
    `finally` aborts the requests. So does a client that does not read a write within
    `write_timeout`: its connection is closed."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    builders = choice_builders(req, run)
    created = now()
    timeout = request.app[SERVER_CONFIG].write_timeout

    async def send(data: bytes) -> None:
        try:
            await asyncio.wait_for(resp.write(_sse(data)), timeout)
        except asyncio.TimeoutError:
            request.app[METRICS].write_timeouts.inc()
            logger.info("request %s: the client read nothing for write_timeout (%g s); the "
                        "stream is aborted", cmpl_id, timeout)
            if request.transport is not None:
                request.transport.abort()  # drops what the client never read
            raise ClientLeft(cmpl_id) from None

    async for index, out in run.outputs():
        choice = builders[index].delta(out)
        if choice.text or choice.finish_reason or (choice.logprobs and choice.logprobs.tokens):
            await send(fmt.chunk(cmpl_id, created, req.model, [choice]))
    if req.stream_options is not None and req.stream_options.include_usage:
        await send(fmt.chunk(cmpl_id, created, req.model, [], run.usage))
    await send(b"[DONE]")
    await resp.write_eof()
    return resp


def _sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


# -- the other routes ----------------------------------------------------------------------
async def models(request: web.Request) -> web.Response:
    """`GET /v1/models`: the served model (and its underlying name, if different)."""
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "aserve"}
            for name in request.app[MODEL_NAMES]]
    return web.json_response({"object": "list", "data": data})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's `POST /v1/tokenize`: the ids the server would run for a prompt (or a chat)."""
    req = decode_json(await request.read(), TokenizeRequest)
    _check_model(request.app, req.model or request.app[MODEL_NAMES][0])
    engine = request.app[ENGINE]
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("send exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        template = request.app[CHAT_TEMPLATE]
        if template is None:
            raise RequestError(NO_TEMPLATE.format(model=req.model), "messages", 400,
                               "chat_template_missing")
        ids = _chat_prompt(engine, template.render(req.messages, req.add_generation_prompt))
    else:
        ids = engine.tokenizer.encode(req.prompt or "", req.add_special_tokens)
    return web.json_response({"count": len(ids), "max_model_len": engine.max_seq_len,
                              "tokens": ids, "token_strs": None})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's `POST /v1/detokenize`: the text of token ids."""
    req = decode_json(await request.read(), DetokenizeRequest)
    _check_model(request.app, req.model or request.app[MODEL_NAMES][0])
    engine = request.app[ENGINE]
    bad = next((t for t in req.tokens if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {engine.vocab_size})",
                           "tokens")
    return web.json_response({"prompt": engine.tokenizer.decode(req.tokens)})


async def version(request: web.Request) -> web.Response:
    """`GET /version` (vLLM): the server's package version."""
    return web.json_response({"version": _version()})


async def ping(request: web.Request) -> web.Response:
    """`GET|POST /ping` (vLLM, SageMaker): liveness, the same answer as /health."""
    return await health(request)


async def health(request: web.Request) -> web.Response:
    """`GET /health`: 200 while every actor is alive, else 503 (no API key needed). Actor
    names and errors only with `health_details` or to a caller with the API key."""
    engine, config = request.app[ENGINE], request.app[SERVER_CONFIG]
    report = engine.health() if engine.is_running else {"healthy": False, "actors": {}}
    status = 200 if report["healthy"] else 503
    if not (config.health_details or config.api_key and _has_key(request, config.api_key)):
        report = {"healthy": report["healthy"]}
    return web.json_response({"status": "ok" if status == 200 else "unhealthy", **report},
                             status=status, dumps=lambda o: json.dumps(o, default=str))


async def metrics(request: web.Request) -> web.Response:
    """`GET /metrics`: the Prometheus text format of this app's registry."""
    engine, registry = request.app[ENGINE], request.app[METRICS]
    if engine.is_running:
        registry.update(engine.stats(), engine.iterations, engine.num_dropped_iterations)
        registry.observe_errors(engine.error_counts())
    return web.Response(body=registry.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    """`GET /openapi.json`: generated from the msgspec request and response types."""
    return web.json_response(openapi_document("AlignedServe", _version(), (
        ("/v1/chat/completions", ChatCompletionRequest,
         "Create a chat completion (stream=true: server-sent events of chunks)"),
        ("/v1/tokenize", TokenizeRequest, "The token ids of a prompt or a chat (vLLM)"))))


def _version() -> str:
    try:
        return importlib.metadata.version("aserve")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def _checkpoint_dir(model: str) -> str | None:
    """The model's directory or GGUF file (where a chat template may be), None for a
    random-weight preset."""
    return checkpoint_path(model)


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
    runner = guard.GuardedRunner(app, server_config, handler_cancellation=True,
                                 shutdown_timeout=SHUTDOWN_TIMEOUT_S)
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
