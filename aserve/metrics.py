"""Prometheus metrics of one server: a per-app registry, filled from finished requests and
from the engine's stats and iteration records when /metrics is scraped.

Reads the engine; never changes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from aserve.core import IterationRecord, RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0)  # seconds
STEP_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0)  # seconds
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """Every metric of one app, in its own `CollectorRegistry` (apps never share series)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("aserve_requests_running", "Requests in prefill or decode",
                             registry=r)
        self.waiting = Gauge("aserve_requests_waiting", "Requests waiting for prefill",
                             registry=r)
        self.kv_used = Gauge("aserve_kv_blocks_used", "KV blocks in use", ["location"],
                             registry=r)
        self.kv_total = Gauge("aserve_kv_blocks_total", "KV blocks in all", ["location"],
                              registry=r)
        self.finished = Counter("aserve_requests_finished", "Finished requests by reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("aserve_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("aserve_generation_tokens", "Generated tokens",
                                         registry=r)
        self.ttft = self._histogram("aserve_time_to_first_token_seconds",
                                    "Arrival to first token", LATENCY_BUCKETS)
        self.tpot = self._histogram("aserve_time_per_output_token_seconds",
                                    "Mean time between output tokens of a request",
                                    STEP_BUCKETS + LATENCY_BUCKETS[-6:])
        self.e2e = self._histogram("aserve_e2e_request_latency_seconds",
                                   "Arrival to last token", LATENCY_BUCKETS)
        self.forward = self._histogram("aserve_iteration_forward_seconds",
                                       "Forward time of one decode iteration", STEP_BUCKETS)
        self.schedule = self._histogram("aserve_iteration_schedule_seconds",
                                        "Scheduling time before one decode iteration",
                                        STEP_BUCKETS)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)  # exported at 0 before the first request
        self.num_iterations_seen = 0  # absolute count of iteration records observed

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, buckets=sorted(set(buckets)), registry=self.registry)

    def observe_finished(self, out: RequestOutput) -> None:
        """Counts one finished request and its latencies (perf_counter times)."""
        self.finished.labels(out.finish_reason or "abort").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        times = out.token_times
        if out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - out.arrival_time)
        if times:
            self.e2e.observe(times[-1] - out.arrival_time)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def observe_aborted(self, num_prompt_tokens: int, num_generated: int) -> None:
        """Counts a request that ended without a final output (client disconnect)."""
        self.finished.labels("abort").inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated)

    def update(self, stats: Mapping[str, object], iterations: Sequence[IterationRecord],
               num_dropped: int = 0) -> None:
        """Sets the gauges from `engine.stats()` and observes iterations not yet seen;
        `num_dropped` is the absolute index of iterations[0] (the engine trims old ones)."""
        self.running.set(int(stats["running"]))  # type: ignore[call-overload]
        self.waiting.set(int(stats["waiting"]))  # type: ignore[call-overload]
        kv: Mapping[str, tuple[int, int]] = stats["kv"]  # type: ignore[assignment]
        for location, (used, total) in kv.items():
            self.kv_used.labels(location).set(used)
            self.kv_total.labels(location).set(total)
        for record in iterations[max(0, self.num_iterations_seen - num_dropped):]:
            self.forward.observe(record.forward_time)
            self.schedule.observe(record.schedule_time)
        self.num_iterations_seen = num_dropped + len(iterations)

    def render(self) -> bytes:
        """The Prometheus text exposition of the registry."""
        return generate_latest(self.registry)
