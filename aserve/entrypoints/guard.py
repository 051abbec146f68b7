"""What a connection and a request must pass before a handler runs: connection limits
(a deadline on each request head, a cap on open connections), the Host allow-list, CORS,
and the body's media type, transfer coding and read deadline.

aiohttp leaves these open (no head or body deadline, no connection cap, any Host, any
Content-Type). Nothing here parses a body's fields or knows the engine.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable, Callable

import aiohttp_cors
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from aserve.engine.config import ServerConfig
from aserve.entrypoints.protocol import RequestError, clip, error_json

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LINGER_S = 1.0  # seconds a closing connection still drains a body it did not read
PROBE_SLOTS = 4  # connections past max_connections kept for the probes below
PROBE_PATHS = ("/health", "/ping", "/metrics")  # served on a probe slot
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
BODY_METHODS = ("POST", "PUT", "PATCH")
GUARD_CONFIG = web.AppKey("guard_config", ServerConfig)


# -- connections ---------------------------------------------------------------------------
class GuardedRunner(web.AppRunner):
    """An AppRunner whose server keeps `config`'s connection limits: keep-alive and head
    deadlines, and at most `max_connections` open connections (past it: 503, then close)."""

    def __init__(self, app: web.Application, config: ServerConfig, **kwargs: object) -> None:
        super().__init__(app, keepalive_timeout=config.keepalive_timeout,
                         lingering_time=LINGER_S, **kwargs)  # type: ignore[arg-type]
        self.limits = config

    async def _make_server(self) -> Server:
        return GuardedServer(await super()._make_server(), self.limits)


class GuardedServer(Server):
    """aiohttp's Server (the protocol factory) with a connection cap and head deadlines."""

    def __init__(self, base: Server, config: ServerConfig) -> None:
        # NOTE: aiohttp builds its Server inside Application; this one copies its settings
        super().__init__(base.request_handler, request_factory=base.request_factory,
                         handler_cancellation=base.handler_cancellation,
                         loop=base._loop, **base._kwargs)
        self.max_connections = config.max_connections
        self.header_timeout = config.header_timeout
        self.num_refused = 0  # connections turned away at the cap

    def __call__(self) -> RequestHandler:
        num_open = len(self._connections)
        if num_open >= self.max_connections + PROBE_SLOTS:
            self.num_refused += 1
            return RefusedConnection(self._loop, self.max_connections)  # type: ignore[return-value]
        handler = GuardedHandler(self, loop=self._loop, header_timeout=self.header_timeout,
                                 **self._kwargs)
        handler.is_probe_slot = num_open >= self.max_connections  # `slot_middleware`
        return handler


class GuardedHandler(RequestHandler):
    """A connection whose every request head must arrive within `header_timeout` seconds:
    from the connection's start, and from the first byte of each later request. Silence
    between requests is the keep-alive timeout's business."""

    def __init__(self, manager: Server, *, header_timeout: float, **kwargs: object) -> None:
        super().__init__(manager, **kwargs)  # type: ignore[arg-type]
        self.header_timeout = header_timeout
        self.num_heads = 0  # request heads parsed on this connection
        self.is_probe_slot = False  # opened past max_connections: only PROBE_PATHS served
        self.head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        # NOTE: reads aiohttp's own counters: no public hook says "a head was parsed"
        is_idle = self._current_request is None and not self._messages
        super().data_received(data)
        if self._request_count != self.num_heads:
            self.num_heads = self._request_count
            self._disarm_head_deadline()
        elif is_idle and self.head_deadline is None:
            self._arm_head_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self.head_deadline = self._loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _head_timed_out(self) -> None:
        self.head_deadline = None
        if self._request_count == self.num_heads:
            self.force_close()


class RefusedConnection(asyncio.Protocol):
    """A connection past the cap: a 503 at once, then close once the client has sent its
    request (read and dropped, so that the close does not reset the answer) or after LINGER_S."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_connections: int) -> None:
        self.loop = loop
        body = error_json(f"the server has max_connections ({max_connections}) open; retry "
                          "later", "server_error", None, "too_many_connections")
        self.answer = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json"
                       b"\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
                       % len(body)) + body
        self.transport: asyncio.Transport | None = None
        self.closer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.answer)  # type: ignore[union-attr]
        self.closer = self.loop.call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.transport is not None and b"\r\n\r\n" in data:
            self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.closer is not None:
            self.closer.cancel()


# -- requests ------------------------------------------------------------------------------
def install(app: web.Application, config: ServerConfig) -> None:
    """Gives the middlewares here their config and, when origins are configured, puts CORS
    on every route (call after every route is added)."""
    app[GUARD_CONFIG] = config
    if config.allowed_origins:
        options = aiohttp_cors.ResourceOptions(
            allow_headers=("Authorization", "Content-Type"), expose_headers=("Retry-After",),
            allow_methods=("GET", "POST"), max_age=600)
        cors = aiohttp_cors.setup(app, defaults={o: options for o in config.allowed_origins})
        for route in list(app.router.routes()):
            cors.add(route)


def is_allowed_host(host: str, request: web.Request, config: ServerConfig) -> bool:
    """Whether a Host header names this server: a loopback name, the bound address, the
    address the connection arrived on, or a name in `allowed_hosts` ("*": any)."""
    if "*" in config.allowed_hosts:
        return True
    name = _hostname(host)
    allowed = {*LOOPBACK_HOSTS, config.host.lower(), *(h.lower() for h in config.allowed_hosts)}
    if name in allowed:
        return True
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return sockname is not None and _is_ip(name) and name == str(sockname[0]).lower()


def _hostname(host: str) -> str:
    """`Host` without its port, lower case, brackets and a trailing dot removed."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@web.middleware
async def slot_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """On a connection opened past `max_connections` (a probe slot), only PROBE_PATHS are
    served: /health and /metrics answer however many connections clients hold open."""
    if getattr(request.protocol, "is_probe_slot", False) and request.path not in PROBE_PATHS:
        limit = request.app[GUARD_CONFIG].max_connections
        raise RequestError(f"the server has max_connections ({limit}) open; retry later",
                           None, 503, "too_many_connections")
    return await handler(request)


@web.middleware
async def host_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """421 unless the Host header names this server: a page on another name that DNS
    rebinding pointed here cannot read or drive it. (aiohttp refuses HTTP/1.1 without Host;
    browsers always send it.)"""
    host = request.headers.get("Host")
    if host is not None and not is_allowed_host(host, request, request.app[GUARD_CONFIG]):
        raise RequestError(f"Host {clip(host)!r} is not served here; start the server with "
                           "--allowed-hosts to accept it", "Host", 421, "host_not_allowed")
    return await handler(request)


@web.middleware
async def body_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Before a handler sees a body: only JSON (415 otherwise, nothing read), only the chunked
    transfer coding (501 otherwise), and the whole body within `body_timeout` (408). A request
    without a body (`POST /ping`) has nothing to check."""
    if (request.method not in BODY_METHODS or not request.body_exists
            or request.match_info.http_exception is not None):
        return await handler(request)
    codings = [c.strip().lower() for v in request.headers.getall("Transfer-Encoding", ())
               for c in v.split(",")]
    if codings not in ([], ["chunked"]):
        raise RequestError(f"Transfer-Encoding {clip(', '.join(codings))!r} is not supported; "
                           "send the body plain or chunked", "Transfer-Encoding", 501,
                           "unsupported_transfer_coding")
    if not _is_json(request):
        raise RequestError(f"Content-Type {clip(request.headers.get('Content-Type', ''))!r} is "
                           "not supported; send 'application/json' (UTF-8)", "Content-Type",
                           415, "unsupported_media_type")
    timeout = request.app[GUARD_CONFIG].body_timeout
    try:
        await asyncio.wait_for(request.read(), timeout)  # handlers' read() returns it again
    except asyncio.TimeoutError:
        raise RequestError(f"the request body did not arrive within body_timeout ({timeout} s)",
                           "body", 408, "body_timeout") from None
    return await handler(request)


def _is_json(request: web.Request) -> bool:
    charset = (request.charset or "").lower() or None
    return request.content_type == "application/json" and charset in (None, "utf-8", "utf8")
