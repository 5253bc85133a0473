"""Prometheus metrics for the HTTP server's `GET /metrics`, through prometheus_client (the field's library).

Two sources:
- per request, in the HTTP process (`RequestTimer`, fed by TokenizerManager.generate): requests
  by finish reason, prompt and generated tokens, and the latency histograms (time to first token,
  time per output token, inter-token latency, end to end);
- per DP rank, read from the schedulers at scrape time (`observe_schedulers`, the same stats as
  /get_server_info): running and waiting requests, KV pages used and in total, graph replays by
  kind and bucket, eager fallbacks by reason, forward passes.

Every metric lives in the server's own registry (no process-global state: two servers in one
process, as the tests run them, do not share counts). Names carry the `sglang:` prefix SGLang
and vLLM use.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "sglang:"
# seconds: from a few ms (a decode step on a GPU) to minutes (a long CPU generation)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0,
                   20.0, 40.0, 80.0, 160.0, 320.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Finished requests by finish reason (stop, length: the model's; "
                                "abort: the client went away or the request was cancelled; error: failed)",
                                ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:  # every series exists from the start (rate() needs a zero)
            self.requests.labels(reason)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens streamed to clients",
                                         registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Request arrival to its first output token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Per request: (end to end - time to first token) / (output tokens - 1)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Gap between successive output chunks, per token in the later chunk",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request arrival to its last output",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge(PREFIX + "num_requests_in_flight",
                               "Requests the HTTP server is waiting on (queued or running)", registry=r)
        rank = ["dp_rank"]
        self.running = Gauge(PREFIX + "num_running_reqs", "Requests in the running batch", rank, registry=r)
        self.waiting = Gauge(PREFIX + "num_queue_reqs", "Requests waiting to be scheduled", rank, registry=r)
        self.pages_used = Gauge(PREFIX + "kv_pages_used", "KV-cache pages requests hold", rank, registry=r)
        self.pages_cached = Gauge(PREFIX + "kv_pages_cached",
                                  "KV-cache pages only the prefix cache holds (freed on demand)", rank, registry=r)
        self.pages_total = Gauge(PREFIX + "kv_pages_total", "KV-cache pages in the pool", rank, registry=r)
        self.page_size = Gauge(PREFIX + "kv_page_size_tokens", "Tokens per KV-cache page", rank, registry=r)
        # the schedulers count these themselves; a scrape copies their totals (monotonic)
        self.replays = Gauge(PREFIX + "graph_replays_total", "Graph replays by graph kind and bucket",
                             rank + ["kind", "bucket"], registry=r)
        self.fallbacks = Gauge(PREFIX + "graph_fallbacks_total", "Steps a graph kind left to eager, by reason",
                               rank + ["kind", "reason"], registry=r)
        self.forwards = Gauge(PREFIX + "forward_passes_total", "Forward passes by mode", rank + ["mode"],
                              registry=r)

    def start_request(self) -> "RequestTimer":
        return RequestTimer(self)

    def observe_schedulers(self, per_rank: list[dict]) -> None:
        """Copy each DP rank's live stats (Scheduler.get_stats) into the per-rank gauges."""
        for rank, stats in enumerate(per_rank):
            r = str(rank)
            self.running.labels(r).set(stats.get("num_running_reqs", 0))
            self.waiting.labels(r).set(stats.get("num_waiting_reqs", 0))
            total = stats.get("num_total_pages", 0)
            self.pages_total.labels(r).set(total)
            cached = stats.get("num_evictable_pages", 0)
            self.pages_cached.labels(r).set(cached)
            self.pages_used.labels(r).set(total - stats.get("num_free_pages", total) - cached)
            self.page_size.labels(r).set(stats.get("page_size", 0))
            for key, value in stats.items():
                if key.endswith("_replays_by_bucket") and isinstance(value, dict):
                    kind = key[: -len("_replays_by_bucket")]
                    for bucket, n in value.items():
                        self.replays.labels(r, kind, str(bucket)).set(n)
                elif key.endswith("_fallbacks") and isinstance(value, dict):
                    kind = key[: -len("_fallbacks")]
                    for reason, n in value.items():
                        self.fallbacks.labels(r, kind, str(reason)).set(n)
                elif key.startswith("num_forwards_") and isinstance(value, (int, float)):
                    self.forwards.labels(r, key[len("num_forwards_"):]).set(value)

    def render(self) -> tuple[bytes, str]:
        """(the exposition text, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """One request's latencies, observed as its output chunks reach the HTTP process."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self.start = self.last = time.perf_counter()
        self.first: float | None = None
        self.tokens = 0
        self.done = False
        metrics.in_flight.inc()

    def chunk(self, n_tokens: int) -> None:
        """A chunk with n_tokens new output tokens arrived."""
        if n_tokens <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.m.ttft.observe(now - self.start)
        else:
            gap = (now - self.last) / n_tokens
            for _ in range(n_tokens):
                self.m.itl.observe(gap)
        self.last = now
        self.tokens += n_tokens
        self.m.generation_tokens.inc(n_tokens)

    def finish(self, reason: str, prompt_tokens: int = 0) -> None:
        """Once, however the request ended: reason one of FINISH_REASONS."""
        if self.done:
            return
        self.done = True
        now = time.perf_counter()
        self.m.in_flight.dec()
        self.m.requests.labels(reason if reason in FINISH_REASONS else "stop").inc()
        self.m.prompt_tokens.inc(prompt_tokens)
        if reason in ("stop", "length"):
            self.m.e2e.observe(now - self.start)
            if self.first is not None and self.tokens > 1:
                self.m.tpot.observe((now - self.first) / (self.tokens - 1))
