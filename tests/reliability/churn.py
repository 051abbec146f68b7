"""The churn mix an operator's load brings, against `aserve serve` run as its own process on
loopback: Poisson arrivals; prompts of 10-2,000 characters with max_tokens 8-512; half with
`ignore_eos`, a tenth with n = 4, 70 % streamed; 30 % of the streams hang up 0.05-3 s in and
about 6 % of the clients abort right after sending. A prober asks /health throughout.

`run_churn` returns what a soak asserts: the statuses, the finish reasons, /health's answers
and times, the server's log, its resident memory, its event-loop lag and its KV blocks left.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import string
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from aserve.engine.config import ServerConfig
from tests.aserve.conftest import parse_metrics

HEALTH_EVERY_S = 0.5
HEALTH_TIMEOUT_S = 5.0  # a probe slower than 1 s fails the soak; this only ends the wait
SETTLE_S = 600.0  # most seconds the server may take to finish what is left at the end
RUN_LIMIT_S = 3600.0  # most seconds the clients of one run may take in all
READY_S = 300.0  # most seconds `aserve serve` may take to listen
MAX_CLIENT_CONNECTIONS = 256
CLIENT_KEEPALIVE_S = ServerConfig().keepalive_timeout / 2  # see ``run_churn``
ALPHABET = string.ascii_letters + string.digits + "     .,"


@dataclass(frozen=True)
class Client:
    """One client: what it sends, when, and how it leaves."""

    start_time: float  # seconds after the churn starts
    prompt: str
    max_tokens: int
    ignore_eos: bool
    n: int
    stream: bool
    hang_up_after: float | None  # a stream's seconds before it hangs up; None: reads it all
    abort_at_once: bool  # closes right after sending


def churn_mix(num: int, rate: float, seed: int, max_tokens: int = 512) -> list[Client]:
    rng = random.Random(seed)
    clients, at = [], 0.0
    for _ in range(num):
        at += rng.expovariate(rate)
        stream = rng.random() < 0.7
        clients.append(Client(
            at, "".join(rng.choices(ALPHABET, k=rng.randint(10, 2000))),
            rng.randint(8, max_tokens), rng.random() < 0.5, 4 if rng.random() < 0.1 else 1,
            stream, rng.uniform(0.05, 3.0) if stream and rng.random() < 0.3 else None,
            rng.random() < 0.06))
    return clients


def kv_high_water(num: int, seed: int, max_tokens: int = 512) -> list[Client]:
    """`num` clients at once, each with a 2,000-character prompt and `max_tokens` to read
    in full: they take the KV stores to about the high-water mark `num` concurrent requests
    can reach. KV tensors are allocated untouched and fault in as blocks are first used,
    so a soak warms up with these before it takes the resident memory it compares with."""
    rng = random.Random(seed)
    return [Client(0.0, "".join(rng.choices(ALPHABET, k=2000)), max_tokens, True, 1, False,
                   None, False) for _ in range(num)]


@dataclass
class ChurnResult:
    statuses: Counter[int] = field(default_factory=Counter)  # HTTP statuses of the answers
    finishes: Counter[str] = field(default_factory=Counter)  # finish reasons of the choices
    hung_up: int = 0  # clients that left as planned
    health: list[tuple[float, int]] = field(default_factory=list)  # (seconds, status)
    log: str = ""
    rss_warm: int = 0  # bytes, once warmed up
    rss_end: int = 0
    kv_touched_warm: float = 0.0  # bytes of KV memory ever written (aserve_kv_touched_bytes)
    kv_touched_end: float = 0.0
    loop_lag: dict[float, float] = field(default_factory=dict)  # bucket bound -> count
    kv_used_end: dict[str, float] = field(default_factory=dict)
    refusals: dict[str, float] = field(default_factory=dict)  # 429s by cause, from /metrics
    duration: float = 0.0

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.log.splitlines()
                if " ERROR " in line or "Traceback" in line or " CRITICAL " in line]

    @property
    def stall_lines(self) -> list[str]:
        """The watchdog's WARNINGs: event-loop iterations over its threshold."""
        return [line for line in self.log.splitlines() if "the event loop was held" in line]

    @property
    def rss_growth(self) -> float:
        """Resident memory's growth over the run, less the KV blocks first written during it
        (KV tensors are allocated untouched and bounded by their capacity; what they fault in
        is KV, not a leak)."""
        kv_new = self.kv_touched_end - self.kv_touched_warm
        return (self.rss_end - kv_new) / self.rss_warm - 1

    def lag_share_within(self, bound: float) -> float:
        """The share of heartbeats whose lag was at most `bound` seconds (a bucket bound)."""
        total = self.loop_lag.get(float("inf"), 0.0)
        return self.loop_lag[bound] / total if total else 0.0

    def summary(self) -> str:
        slowest = max((t for t, _ in self.health), default=0.0)
        return (f"{sum(self.statuses.values())} answers {dict(self.statuses)}, finishes "
                f"{dict(self.finishes)}, {self.hung_up} hung up; /health {len(self.health)} "
                f"probes, slowest {slowest * 1000:.0f} ms; RSS {self.rss_warm / 2**20:.0f} -> "
                f"{self.rss_end / 2**20:.0f} MiB ({self.rss_end / self.rss_warm - 1:+.1%}; KV "
                f"first written {(self.kv_touched_end - self.kv_touched_warm) / 2**20:.0f} MiB, "
                f"growth besides {self.rss_growth:+.1%}); "
                f"loop lag <= 50 ms: {self.lag_share_within(0.05):.2%} of "
                f"{self.loop_lag.get(float('inf'), 0):.0f} beats, "
                f"{len(self.stall_lines)} held over 250 ms; KV used at the end "
                f"{self.kv_used_end}; 429s {self.refusals}; {self.duration:.0f} s")


class ServerProcess:
    """`aserve serve` on 127.0.0.1 (a free port), its log in `log_path`."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
               "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self.log_path = log_path
        self.log_file = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
             "--port", "0", *args], stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        self.url = ""

    async def ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while not self.url:
            match = re.search(r"on (http://127\.0\.0\.1:\d+)", self.log)
            if match:
                self.url = match.group(1)
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"aserve serve did not start:\n{self.log[-3000:]}")
            else:
                await asyncio.sleep(0.2)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.log_file.close()


async def _client(session: aiohttp.ClientSession, url: str, model: str, c: Client,
                  result: ChurnResult, t0: float) -> None:
    await asyncio.sleep(max(0.0, t0 + c.start_time - time.monotonic()))
    body = {"model": model, "prompt": c.prompt, "max_tokens": c.max_tokens,
            "ignore_eos": c.ignore_eos, "n": c.n, "stream": c.stream, "temperature": 1.0}
    if c.abort_at_once:
        await _send_and_close(url, body)
        result.hung_up += 1
        return
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            result.statuses[resp.status] += 1
            if resp.status != 200:
                await resp.read()
                return
            if not c.stream:
                for choice in (await resp.json())["choices"]:
                    result.finishes[choice["finish_reason"]] += 1
                return
            hang_up_at = None if c.hang_up_after is None else time.monotonic() + c.hang_up_after
            async for line in resp.content:
                if hang_up_at is not None and time.monotonic() > hang_up_at:
                    result.hung_up += 1
                    return  # leaving the block closes the connection mid-stream
                if line.startswith(b"data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        if choice["finish_reason"] is not None:
                            result.finishes[choice["finish_reason"]] += 1
    except aiohttp.ClientError as exc:
        result.statuses[f"client error: {type(exc).__name__}"] += 1  # type: ignore[index]


def request_bytes(body: dict[str, object], path: str = "/v1/completions") -> bytes:
    data = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))


def never_reading(port: int, body: dict[str, object], source: str = "127.0.0.1") -> socket.socket:
    """A client (from loopback address `source`) that sends a request and never reads, with
    a small receive buffer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    sock.sendall(request_bytes(body))
    return sock


async def _send_and_close(url: str, body: dict[str, object]) -> None:
    """Sends a request on a raw socket and closes it at once (before any answer)."""
    host, port = url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(request_bytes(body))
    await writer.drain()
    writer.close()


async def _probe_health(url: str, result: ChurnResult, stop: asyncio.Event) -> None:
    """Asks /health every HEALTH_EVERY_S on a connection of its own, as a load balancer's
    health check does: not from the clients' pool, where it would wait for a free
    connection whenever the clients hold them all."""
    timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            start = time.monotonic()
            try:
                async with session.get(f"{url}/health") as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError):
                status = 0
            result.health.append((time.monotonic() - start, status))
            await asyncio.wait([asyncio.ensure_future(stop.wait())], timeout=HEALTH_EVERY_S)


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        return parse_metrics(await resp.text())


async def _settle(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Waits until nothing runs or waits, and returns the KV blocks used per location."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        m = await scrape(session, url)
        used = {k.split('"')[1]: v for k, v in m.items() if k.startswith("aserve_kv_blocks_used")}
        idle = m["aserve_requests_running"] == 0 and m["aserve_requests_waiting"] == 0
        if (idle and not any(used.values())) or time.monotonic() > deadline:
            return used
        await asyncio.sleep(0.5)


async def run_churn(server: ServerProcess, model: str, clients: list[Client],
                    warmup: list[Client]) -> ChurnResult:
    """Warms the server up with `warmup` (resident memory is measured after it), then runs
    `clients`, lets the server settle, and collects what a soak asserts."""
    result = ChurnResult()
    # NOTE: a pool below the server's connection cap (512 by default), as a client library
    # keeps: arrivals the server cannot keep up with wait here instead of being refused.
    # Its idle connections close before the server's keep-alive timeout does, as a load
    # balancer's do: a pooled connection reused just as the server closes it fails the
    # request (ServerDisconnectedError), a race of HTTP keep-alive, not of the server.
    connector = aiohttp.TCPConnector(limit=MAX_CLIENT_CONNECTIONS,
                                     keepalive_timeout=CLIENT_KEEPALIVE_S)
    # NOTE: no total per request: under overload a request may wait long for a pooled
    # connection; a silent server still fails the read, and the whole run is bounded
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=SETTLE_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await server.ready()
        warm = ChurnResult()
        t0 = time.monotonic()
        await asyncio.gather(*(_client(session, server.url, model, c, warm, t0) for c in warmup))
        await _settle(session, server.url)
        result.rss_warm = server.rss()
        m = await scrape(session, server.url)
        result.kv_touched_warm = m["aserve_kv_touched_bytes"]
        warm_refusals = {cause: m[f"aserve_{cause}_refusals_total"]
                         for cause in ("overload", "client_budget")}
        stop = asyncio.Event()
        t0 = time.monotonic()
        tasks = [asyncio.create_task(_client(session, server.url, model, c, result, t0))
                 for c in clients]
        # NOTE: the probes start once every client task has begun (each waits for its start
        # time): starting thousands of tasks holds this loop, not the server's
        await asyncio.sleep(0)
        prober = asyncio.create_task(_probe_health(server.url, result, stop))
        await asyncio.wait_for(asyncio.gather(*tasks), RUN_LIMIT_S)
        result.kv_used_end = await _settle(session, server.url)
        result.duration = time.monotonic() - t0
        stop.set()
        await prober
        result.rss_end = server.rss()
        m = await scrape(session, server.url)
        result.kv_touched_end = m["aserve_kv_touched_bytes"]
        for name, value in m.items():
            if name.startswith("aserve_event_loop_lag_seconds_bucket"):
                result.loop_lag[float(name.split('"')[1])] = value
        result.refusals = {cause: m[f"aserve_{cause}_refusals_total"] - warm_refusals[cause]
                           for cause in ("overload", "client_budget")}
    return result
