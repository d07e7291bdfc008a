"""Prometheus metrics for `GET /metrics`, named and typed exactly as SGLang's, or as vLLM's
(`--metrics-naming vllm`).

Dashboards, KEDA autoscalers and gateways written for either engine read these series unchanged. The
API process owns the only registry: scheduler numbers arrive as a stats dict over a socket and request
timings are observed here when a request finishes, so no multiprocess aggregation is needed.

Each series is one line of `SERIES`: its name in each scheme, or None where that engine has no such
series (a series a scheme lacks is a no-op here, so the update code is the same for both).

The same load figures also go out per response, as vLLM's ORCA load report: a request with the header
`endpoint-load-metrics-format: TEXT|JSON` is answered with `endpoint-load-metrics` (Envoy and gateways route on
it without scraping).
"""

from __future__ import annotations

import json

import prometheus_client as prom
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

# SGLang and vLLM export through prometheus_client's multiprocess collector, which emits no `*_created`
# series; without this each counter/histogram would add an extra `*_created` gauge family.
# (Process-wide, read at scrape time.)
prom.disable_created_metrics()

NAMINGS = ("sglang", "vllm")

# Roughly log-spaced (1-2.5-5 per decade) bucket upper bounds, in seconds.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)  # also TPOT
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))  # vLLM's 1-2-5 token counts, to 5M

G, C, H = prom.Gauge, prom.Counter, prom.Histogram
# attribute: (type, SGLang name, vLLM name, help, histogram buckets). Counter names omit `_total`:
# prometheus_client appends it.
SERIES: dict[str, tuple] = {
    "num_running": (G, "num_running_reqs", "num_requests_running", "Requests in the running batch.", None),
    "num_queue": (G, "num_queue_reqs", "num_requests_waiting", "Requests waiting to be scheduled.", None),
    "token_usage": (G, "token_usage", "kv_cache_usage_perc", "Fraction of the KV pool held by running requests.",
                    None),
    "num_used_tokens": (G, "num_used_tokens", None, "KV-cache tokens held by running requests.", None),
    "cache_hit_rate": (G, "cache_hit_rate", None, "Prefix-cache hit tokens / admitted prompt tokens.", None),
    "gen_throughput": (G, "gen_throughput", None, "Generated tokens per second (last interval).", None),
    "num_retracted": (G, "num_retracted_reqs", None, "Requests retracted for lack of KV memory (cumulative).",
                      None),
    "num_preemptions": (C, None, "num_preemptions", "Requests preempted (retracted) for lack of KV memory.", None),
    "prompt_tokens": (C, "prompt_tokens", "prompt_tokens", "Prompt tokens of finished requests.", None),
    "generation_tokens": (C, "generation_tokens", "generation_tokens", "Generated tokens of finished requests.",
                          None),
    "cached_tokens": (C, "cached_tokens", "prefix_cache_hits", "Prompt tokens served from the prefix cache.", None),
    "cache_queries": (C, None, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", None),
    "num_requests": (C, "num_requests", None, "Finished requests.", None),
    "ttft": (H, "time_to_first_token_seconds", "time_to_first_token_seconds", "Time to first token.",
             TTFT_BUCKETS),
    "itl": (H, "inter_token_latency_seconds", "inter_token_latency_seconds", "Gap between output tokens.",
            ITL_BUCKETS),
    "e2e": (H, "e2e_request_latency_seconds", "e2e_request_latency_seconds", "Request latency, arrival to finish.",
            E2E_BUCKETS),
    "tpot": (H, "time_per_output_token_seconds", "request_time_per_output_token_seconds",
             "Decode time per output token after the first.", ITL_BUCKETS),
    "request_prompt_tokens": (H, None, "request_prompt_tokens", "Prompt tokens per finished request.",
                              TOKEN_BUCKETS),
    "request_generation_tokens": (H, None, "request_generation_tokens", "Generated tokens per finished request.",
                                  TOKEN_BUCKETS),
    "queue_time": (H, None, "request_queue_time_seconds", "Arrival to first scheduled.", E2E_BUCKETS),
    "prefill_time": (H, None, "request_prefill_time_seconds", "First scheduled to first token.", E2E_BUCKETS),
    "decode_time": (H, None, "request_decode_time_seconds", "First token to finish.", E2E_BUCKETS),
    "inference_time": (H, None, "request_inference_time_seconds", "First scheduled to finish.", E2E_BUCKETS),
    "params_n": (H, None, "request_params_n", "The n of each prompt of a request.", (1, 2, 5, 10, 20)),
    "params_max_tokens": (H, None, "request_params_max_tokens", "The max_tokens of each prompt of a request.",
                          TOKEN_BUCKETS),
    "iteration_tokens": (H, None, "iteration_tokens_total", "Tokens per engine step: prompt tokens computed plus "
                         "tokens sampled.", TOKEN_BUCKETS),
}


class _Absent:
    """A series this naming scheme does not have: every update is a no-op."""

    def set(self, value: float = 1) -> None:
        pass

    inc = observe = set


class Metrics:
    """One registry per instance (not the global default), so several can coexist in a process."""

    def __init__(self, model_name: str, naming: str = "sglang"):
        if naming not in NAMINGS:
            raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
        self.registry = prom.CollectorRegistry()
        # SGLang labels its series with the model; vLLM also with the engine index (one engine here: "0").
        labels = {"model_name": model_name} | ({"engine": "0"} if naming == "vllm" else {})
        for attribute, (kind, *names, doc, buckets) in SERIES.items():
            name = names[NAMINGS.index(naming)]
            metric = _Absent() if name is None else kind(
                f"{naming}:{name}", doc, list(labels), registry=self.registry,
                **({"buckets": buckets} if buckets else {})).labels(**labels)
            setattr(self, attribute, metric)
        # vLLM counts finished requests by how they ended; SGLang's series carry only `model_name`.
        self.request_success = None if naming != "vllm" else prom.Counter(
            "vllm:request_success", "Finished requests, by finish reason.", [*labels, "finished_reason"],
            registry=self.registry)
        # vLLM's KV-cache settings as labels of a constant 1 (set from the first scheduler stats).
        self.cache_config = None if naming != "vllm" else prom.Gauge(
            "vllm:cache_config_info", "KV cache configuration.", [*labels, "block_size", "num_gpu_blocks"],
            registry=self.registry)
        self.labels = labels
        self.retracted_seen = 0  # the scheduler reports a running total; vLLM's counter takes increments
        self.load = {"kv_cache_usage_perc": 0.0, "num_requests_waiting": 0.0}  # the ORCA report's, under vLLM's names

    def update_scheduler(self, stats: dict) -> None:
        """Set the gauges from the scheduler's latest stats message."""
        used_pages = stats["total_pages"] - stats["free_pages"] - stats["evictable_pages"]
        self.num_running.set(stats["num_running"])
        self.num_queue.set(stats["num_waiting"])
        self.num_used_tokens.set(used_pages * stats["page_size"])
        usage = used_pages / stats["total_pages"] if stats["total_pages"] else 0.0
        self.token_usage.set(usage)
        self.load = {"kv_cache_usage_perc": usage, "num_requests_waiting": float(stats["num_waiting"])}
        admitted = stats["prompt_tokens_admitted"]
        self.cache_hit_rate.set(stats["cache_hit_tokens"] / admitted if admitted else 0.0)
        self.gen_throughput.set(stats["gen_throughput"])
        self.num_retracted.set(stats["num_retracted"])
        self.num_preemptions.inc(max(0, stats["num_retracted"] - self.retracted_seen))
        self.retracted_seen = max(self.retracted_seen, stats["num_retracted"])
        if self.cache_config is not None:
            self.cache_config.labels(**self.labels, block_size=str(stats["page_size"]),
                                     num_gpu_blocks=str(stats["total_pages"])).set(1)

    def load_report(self, fmt: str | None) -> dict[str, str]:
        """vLLM's ORCA header for a request that asked for one in format `fmt` (TEXT or JSON, any case); none for
        another format, as vLLM answers."""
        fmt = (fmt or "").lower()
        if fmt == "text":
            return {"endpoint-load-metrics": "TEXT " + ", ".join(f"named_metrics.{name}={value}"
                                                                 for name, value in self.load.items())}
        if fmt == "json":
            return {"endpoint-load-metrics": "JSON " + json.dumps({"named_metrics": self.load})}
        return {}

    def observe_steps(self, step_tokens: dict[int, int]) -> None:
        """The engine steps since the scheduler's last stats: {tokens in a step: how many steps had that}."""
        for tokens, steps in step_tokens.items():
            for _ in range(steps):
                self.iteration_tokens.observe(tokens)

    def observe_request(self, n: int, max_tokens: int) -> None:
        """One prompt of a request, as it is admitted."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                         ttft: float | None, e2e: float, finish_reason: str | None,
                         queued: float | None = None) -> None:
        """Record one finished request (its inter-token latencies went to `observe_itl` as they came). ttft is
        None when no token was produced (e.g. aborted early), queued (arrival to first scheduled) when it was
        never scheduled."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.cache_queries.inc(prompt_tokens)
        self.num_requests.inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(completion_tokens)
        if self.request_success is not None:
            self.request_success.labels(**self.labels, finished_reason=finish_reason or "abort").inc()
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            self.decode_time.observe(e2e - ttft)
            if completion_tokens > 1:
                self.tpot.observe((e2e - ttft) / (completion_tokens - 1))
        if queued is not None:
            self.queue_time.observe(queued)
            self.inference_time.observe(max(0.0, e2e - queued))
            if ttft is not None:
                self.prefill_time.observe(max(0.0, ttft - queued))

    def observe_itl(self, seconds: float) -> None:
        """One output's inter-token latency, recorded as it is routed (as vLLM records them per step): ~1 us
        each, where all of a stream's at its end (256 streams of 256 tokens finishing together) held the
        event loop for tens of ms."""
        self.itl.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for the HTTP response, in Prometheus text format 0.0.4."""
        return prom.generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
