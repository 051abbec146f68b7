"""Prometheus metrics of one server: a per-app registry, filled from finished requests and
from the engine's stats and iteration records when /metrics is scraped. The main series are
exported under vLLM's names as well (`vllm:*`, labelled by model_name), so dashboards built
for vLLM work unchanged.

Reads the engine; never changes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from aserve.engine.sequence import IterationRecord, RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0)  # seconds
STEP_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0)  # seconds
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # s
FINISH_REASONS = ("stop", "length", "abort", "error")


def _observe_request(out: RequestOutput, prompt_tokens: Counter, generation_tokens: Counter,
                     ttft: Histogram, e2e: Histogram) -> None:
    """Counts a finished request's tokens and observes its first-token and end latencies."""
    prompt_tokens.inc(len(out.prompt_token_ids))
    generation_tokens.inc(len(out.token_ids))
    if out.first_token_time is not None:
        ttft.observe(out.first_token_time - out.arrival_time)
    if out.token_times:
        e2e.observe(out.token_times[-1] - out.arrival_time)


class VllmMetrics:
    """The series vLLM's dashboards read, with vLLM's names, labels and meanings.

    `gpu_cache_usage_perc` is the decode tier's KV usage (where requests run; on a CPU too)
    and `cpu_cache_usage_perc` the host pool's, as vLLM v0 named its two tiers;
    `time_per_output_token_seconds` observes every gap between two tokens of a request."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labels, registry=registry,
                             buckets=sorted(set(buckets))).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in prefill or decode")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for prefill")
        self.gpu_cache = gauge("vllm:gpu_cache_usage_perc",
                               "Fraction of the decode KV cache in use (1 = full)")
        self.kv_cache = gauge("vllm:kv_cache_usage_perc",
                              "Fraction of the decode KV cache in use (vLLM v1's name)")
        self.cpu_cache = gauge("vllm:cpu_cache_usage_perc",
                               "Fraction of the host KV pool in use (1 = full)")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.success = Counter("vllm:request_success", "Finished requests by reason",
                               labelnames=["model_name", "finished_reason"], registry=registry)
        self.model_name = model_name
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token",
                              LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Time between two output tokens", STEP_BUCKETS + LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token",
                             LATENCY_BUCKETS)

    def observe_finished(self, out: RequestOutput) -> None:
        self.success.labels(self.model_name, out.finish_reason or "abort").inc()
        _observe_request(out, self.prompt_tokens, self.generation_tokens, self.ttft, self.e2e)
        for before, after in zip(out.token_times, out.token_times[1:]):
            self.tpot.observe(after - before)

    def update(self, stats: Mapping[str, object]) -> None:
        self.running.set(int(stats["running"]))  # type: ignore[call-overload]
        self.waiting.set(int(stats["waiting"]))  # type: ignore[call-overload]
        kv: Mapping[str, tuple[int, int]] = stats["kv"]  # type: ignore[assignment]
        for gauge, location in ((self.gpu_cache, "decode"), (self.kv_cache, "decode"),
                                (self.cpu_cache, "host")):
            used, total = kv.get(location, (0, 0))
            gauge.set(used / total if total else 0.0)


class ServerMetrics:
    """Every metric of one app, in its own `CollectorRegistry` (apps never share series)."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.vllm = VllmMetrics(r, model_name)
        self.running = Gauge("aserve_requests_running", "Requests in prefill or decode",
                             registry=r)
        self.waiting = Gauge("aserve_requests_waiting", "Requests waiting for prefill",
                             registry=r)
        self.kv_used = Gauge("aserve_kv_blocks_used", "KV blocks in use", ["location"],
                             registry=r)
        self.kv_total = Gauge("aserve_kv_blocks_total", "KV blocks in all", ["location"],
                              registry=r)
        self.kv_touched = Gauge("aserve_kv_touched_bytes", "Bytes of KV memory written at "
                                "least once (a CPU KV tensor becomes resident as its blocks "
                                "are first used, lowest ids first)", registry=r)
        # on a Ray cluster (aserve/cluster): each instance's node, and its stores' KV
        self.node_online = Gauge("aserve_node_online", "1 while the node of an instance "
                                 "answers, else 0", ["instance"], registry=r)
        self.node_kv_used = Gauge("aserve_node_kv_blocks_used", "KV blocks in use in the "
                                  "stores an instance's node holds", ["instance", "store"],
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
        self.loop_lag = self._histogram("aserve_event_loop_lag_seconds",
                                        "Lateness of the event loop's heartbeat", LAG_BUCKETS)
        self.engine_errors = Counter("aserve_engine_errors", "Errors caught at the engine "
                                     "actors' boundaries, by actor and exception type",
                                     ["actor", "kind"], registry=r)
        self.disconnects = Counter("aserve_client_disconnects", "Requests whose client left "
                                   "before the response ended", registry=r)
        self.write_timeouts = Counter("aserve_write_timeouts", "Streams aborted because their "
                                      "client did not read within write_timeout", registry=r)
        self.client_refusals = Counter("aserve_client_budget_refusals", "Requests refused "
                                       "(429) because their client had its budget or its "
                                       "fair share in flight", registry=r)
        self.overload_refusals = Counter("aserve_overload_refusals", "Requests refused (429) "
                                         "because the engine was overloaded", registry=r)
        self._errors_seen: dict[tuple[str, str], int] = {}
        for reason in FINISH_REASONS:
            self.finished.labels(reason)  # exported at 0 before the first request
        self.num_iterations_seen = 0  # absolute count of iteration records observed

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, buckets=sorted(set(buckets)), registry=self.registry)

    def observe_finished(self, out: RequestOutput) -> None:
        """Counts one finished request and its latencies (perf_counter times)."""
        self.vllm.observe_finished(out)
        self.finished.labels(out.finish_reason or "abort").inc()
        _observe_request(out, self.prompt_tokens, self.generation_tokens, self.ttft, self.e2e)
        times = out.token_times
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def observe_aborted(self, num_prompt_tokens: int, num_generated: int) -> None:
        """Counts a request that ended without a final output (client disconnect)."""
        self.finished.labels("abort").inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated)
        self.vllm.success.labels(self.vllm.model_name, "abort").inc()
        self.vllm.prompt_tokens.inc(num_prompt_tokens)
        self.vllm.generation_tokens.inc(num_generated)

    def update(self, stats: Mapping[str, object], iterations: Sequence[IterationRecord],
               num_dropped: int = 0) -> None:
        """Sets the gauges from `engine.stats()` and observes iterations not yet seen;
        `num_dropped` is the absolute index of iterations[0] (the engine trims old ones)."""
        self.vllm.update(stats)
        self.running.set(int(stats["running"]))  # type: ignore[call-overload]
        self.waiting.set(int(stats["waiting"]))  # type: ignore[call-overload]
        kv: Mapping[str, tuple[int, int]] = stats["kv"]  # type: ignore[assignment]
        for location, (used, total) in kv.items():
            self.kv_used.labels(location).set(used)
            self.kv_total.labels(location).set(total)
        self.kv_touched.set(int(stats.get("kv_touched_bytes", 0)))  # type: ignore[call-overload]
        nodes: Mapping[str, Mapping[str, object]] = stats.get("nodes", {})  # type: ignore[assignment]
        for instance, node in nodes.items():
            self.node_online.labels(instance).set(int(bool(node["online"])))
            for store, used in node["kv_used"].items():  # type: ignore[attr-defined]
                self.node_kv_used.labels(instance, store).set(used)
        for record in iterations[max(0, self.num_iterations_seen - num_dropped):]:
            self.forward.observe(record.forward_time)
            self.schedule.observe(record.schedule_time)
        self.num_iterations_seen = num_dropped + len(iterations)

    def observe_errors(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Counts the engine's errors (`Engine.error_counts`) not yet counted."""
        for key, num in counts.items():
            if num > self._errors_seen.get(key, 0):
                self.engine_errors.labels(*key).inc(num - self._errors_seen.get(key, 0))
                self._errors_seen[key] = num

    def render(self) -> bytes:
        """The Prometheus text exposition of the registry."""
        return generate_latest(self.registry)
