"""Prometheus metrics for `GET /metrics`, named and typed exactly as SGLang's.

Dashboards, KEDA autoscalers and gateways written for SGLang read these series unchanged. The API
process owns the only registry: scheduler numbers arrive as a stats dict over a socket and request
timings are observed here when a request finishes, so no multiprocess aggregation is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import prometheus_client as prom
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

# SGLang exports through prometheus_client's multiprocess collector, which emits no `*_created`
# series; without this each counter/histogram would add an extra `*_created` gauge family.
# (Process-wide, read at scrape time.)
prom.disable_created_metrics()

# Roughly log-spaced (1-2.5-5 per decade) bucket upper bounds, in seconds.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)  # also TPOT
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600)


class Metrics:
    """One registry per instance (not the global default), so several can coexist in a process."""

    def __init__(self, model_name: str):
        self.registry = prom.CollectorRegistry()

        def make(kind, name: str, doc: str, **kw):
            # Bind the only label once; callers then use the child directly.
            metric = kind(f"sglang:{name}", doc, ["model_name"], registry=self.registry, **kw)
            return metric.labels(model_name=model_name)

        g, c, h = prom.Gauge, prom.Counter, prom.Histogram
        self.num_running = make(g, "num_running_reqs", "Requests in the running batch.")
        self.num_queue = make(g, "num_queue_reqs", "Requests waiting to be scheduled.")
        self.num_used_tokens = make(g, "num_used_tokens", "KV-cache tokens held by running requests.")
        self.token_usage = make(g, "token_usage", "Fraction of the KV pool held by running requests.")
        self.cache_hit_rate = make(g, "cache_hit_rate", "Prefix-cache hit tokens / admitted prompt tokens.")
        self.gen_throughput = make(g, "gen_throughput", "Generated tokens per second (last interval).")
        self.num_retracted = make(g, "num_retracted_reqs", "Requests retracted for lack of KV memory (cumulative).")
        # Counter names omit `_total`: prometheus_client appends it.
        self.prompt_tokens = make(c, "prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = make(c, "generation_tokens", "Generated tokens of finished requests.")
        self.cached_tokens = make(c, "cached_tokens", "Prompt tokens served from the prefix cache.")
        self.num_requests = make(c, "num_requests", "Finished requests.")
        self.ttft = make(h, "time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS)
        self.itl = make(h, "inter_token_latency_seconds", "Gap between output tokens.", buckets=ITL_BUCKETS)
        self.e2e = make(h, "e2e_request_latency_seconds", "Request latency, arrival to finish.", buckets=E2E_BUCKETS)
        self.tpot = make(h, "time_per_output_token_seconds", "Decode time per output token after the first.",
                         buckets=ITL_BUCKETS)

    def update_scheduler(self, stats: dict) -> None:
        """Set the gauges from the scheduler's latest stats message."""
        used_pages = stats["total_pages"] - stats["free_pages"] - stats["evictable_pages"]
        self.num_running.set(stats["num_running"])
        self.num_queue.set(stats["num_waiting"])
        self.num_used_tokens.set(used_pages * stats["page_size"])
        self.token_usage.set(used_pages / stats["total_pages"] if stats["total_pages"] else 0.0)
        admitted = stats["prompt_tokens_admitted"]
        self.cache_hit_rate.set(stats["cache_hit_tokens"] / admitted if admitted else 0.0)
        self.gen_throughput.set(stats["gen_throughput"])
        self.num_retracted.set(stats["num_retracted"])

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                         ttft: float | None, e2e: float, itls: Sequence[float], finish_reason: str) -> None:
        """Record one finished request. ttft is None when no token was produced (e.g. aborted early).

        finish_reason is accepted for the caller's convenience but not used as a label: SGLang's
        series carry only `model_name`, and extra labels would change what dashboards aggregate.
        """
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.num_requests.inc()
        self.e2e.observe(e2e)
        for itl in itls:
            self.itl.observe(itl)
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion_tokens > 1:
                self.tpot.observe((e2e - ttft) / (completion_tokens - 1))

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for the HTTP response, in Prometheus text format 0.0.4."""
        return prom.generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
