"""The /metrics contract: SGLang's names and types, correct values, one registry per instance."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from minisgl.server.metrics import Metrics

# Frozen by hand from SGLang's names: dashboards, autoscalers and gateways depend on exactly these.
# (The parser reports counters without `_total` and histograms by their base name.)
EXPECTED_FAMILIES = {
    ("sglang:num_running_reqs", "gauge"),
    ("sglang:num_queue_reqs", "gauge"),
    ("sglang:num_used_tokens", "gauge"),
    ("sglang:token_usage", "gauge"),
    ("sglang:cache_hit_rate", "gauge"),
    ("sglang:gen_throughput", "gauge"),
    ("sglang:num_retracted_reqs", "gauge"),
    ("sglang:prompt_tokens", "counter"),
    ("sglang:generation_tokens", "counter"),
    ("sglang:cached_tokens", "counter"),
    ("sglang:num_requests", "counter"),
    ("sglang:time_to_first_token_seconds", "histogram"),
    ("sglang:inter_token_latency_seconds", "histogram"),
    ("sglang:e2e_request_latency_seconds", "histogram"),
    ("sglang:time_per_output_token_seconds", "histogram"),
}

STATS = dict(num_running=3, num_waiting=5, total_pages=100, free_pages=40, evictable_pages=10, page_size=16,
             cache_hit_tokens=30, prompt_tokens_admitted=120, gen_throughput=123.5, num_retracted=2)


def samples(m: Metrics) -> dict[str, float]:
    """Sample name -> value, skipping histogram buckets (each is checked by _count/_sum instead)."""
    body, _ = m.render()
    return {s.name: s.value for f in text_string_to_metric_families(body.decode())
            for s in f.samples if not s.name.endswith("_bucket")}


def test_frozen_names_and_types():
    body, _ = Metrics("m").render()
    families = {(f.name, f.type) for f in text_string_to_metric_families(body.decode())}
    assert families == EXPECTED_FAMILIES


def test_content_type_is_prometheus_text():
    _, content_type = Metrics("m").render()
    assert content_type.startswith("text/plain; version=0.0.4")


def test_scheduler_gauges():
    m = Metrics("m")
    m.update_scheduler(STATS)
    s = samples(m)
    assert s["sglang:num_running_reqs"] == 3
    assert s["sglang:num_queue_reqs"] == 5
    assert s["sglang:num_used_tokens"] == 800  # (100 - 40 - 10) pages * 16
    assert s["sglang:token_usage"] == pytest.approx(0.5)  # 50 of 100 pages
    assert s["sglang:cache_hit_rate"] == pytest.approx(0.25)  # 30 / 120
    assert s["sglang:gen_throughput"] == pytest.approx(123.5)
    assert s["sglang:num_retracted_reqs"] == 2


def test_cache_hit_rate_without_prompt_tokens_is_zero():
    m = Metrics("m")
    m.update_scheduler({**STATS, "cache_hit_tokens": 0, "prompt_tokens_admitted": 0})
    assert samples(m)["sglang:cache_hit_rate"] == 0


def test_finished_requests_add_up():
    m = Metrics("m")
    for _ in range(4):
        m.observe_itl(0.2)
    m.observe_finished(prompt_tokens=10, completion_tokens=5, cached_tokens=4, ttft=0.2, e2e=1.0,
                       finish_reason="stop")
    m.observe_finished(prompt_tokens=7, completion_tokens=1, cached_tokens=0, ttft=0.1, e2e=0.1, finish_reason="length")
    s = samples(m)
    assert s["sglang:prompt_tokens_total"] == 17
    assert s["sglang:generation_tokens_total"] == 6
    assert s["sglang:cached_tokens_total"] == 4
    assert s["sglang:num_requests_total"] == 2
    assert s["sglang:time_to_first_token_seconds_count"] == 2
    assert s["sglang:time_to_first_token_seconds_sum"] == pytest.approx(0.3)
    assert s["sglang:e2e_request_latency_seconds_count"] == 2
    assert s["sglang:e2e_request_latency_seconds_sum"] == pytest.approx(1.1)
    assert s["sglang:inter_token_latency_seconds_count"] == 4
    assert s["sglang:inter_token_latency_seconds_sum"] == pytest.approx(0.8)
    # Only the first request has more than one token: (1.0 - 0.2) / (5 - 1).
    assert s["sglang:time_per_output_token_seconds_count"] == 1
    assert s["sglang:time_per_output_token_seconds_sum"] == pytest.approx(0.2)


def test_request_without_first_token_skips_ttft_and_tpot():
    m = Metrics("m")
    m.observe_finished(prompt_tokens=3, completion_tokens=0, cached_tokens=0, ttft=None, e2e=0.05,
                       finish_reason="abort")
    s = samples(m)
    assert s["sglang:num_requests_total"] == 1
    assert s["sglang:e2e_request_latency_seconds_count"] == 1
    assert s["sglang:time_to_first_token_seconds_count"] == 0
    assert s["sglang:time_per_output_token_seconds_count"] == 0


def test_every_sample_carries_model_name():
    m = Metrics("org/my-model")
    m.update_scheduler(STATS)
    m.observe_finished(prompt_tokens=4, completion_tokens=3, cached_tokens=0, ttft=0.01, e2e=0.05, finish_reason="stop")
    body, _ = m.render()
    all_samples = [s for f in text_string_to_metric_families(body.decode()) for s in f.samples]
    assert all_samples
    for s in all_samples:
        assert s.labels["model_name"] == "org/my-model", s
        assert set(s.labels) <= {"model_name", "le"}, s  # no extra labels (le only on buckets)


def test_instances_do_not_interfere():
    a, b = Metrics("a"), Metrics("b")
    a.update_scheduler(STATS)
    a.observe_finished(prompt_tokens=10, completion_tokens=2, cached_tokens=0, ttft=0.1, e2e=0.3, finish_reason="stop")
    sa, sb = samples(a), samples(b)
    assert sa["sglang:num_requests_total"] == 1 and sb["sglang:num_requests_total"] == 0
    assert sa["sglang:num_running_reqs"] == 3 and sb["sglang:num_running_reqs"] == 0
    assert b"model_name=\"a\"" not in b.render()[0]
