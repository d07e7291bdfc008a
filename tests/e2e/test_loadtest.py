"""Load tests (loadtest/): the metric definitions on synthetic streams with known timings, and real headless Locust
runs against a real `python -m minisgl --demo` server, read back through Locust's CSVs and report.py."""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx
import kubernetes_validate
import numpy as np
import pytest
import yaml
from server_fixtures import Server

ROOT = Path(__file__).resolve().parents[2]
LOADTEST = ROOT / "loadtest"
sys.path.insert(0, str(LOADTEST))  # stream_metrics is a sibling of the locustfile, not part of the package

from stream_metrics import (  # noqa: E402
    RequestRecord,
    StreamError,
    measure_stream,
    parse_slo,
    percentile,
    read_records,
    summarize,
)

# ---- metric definitions on synthetic streams -------------------------------------------------------------------


def sse(*chunks) -> list[bytes]:
    """A server-sent-event stream as it arrives: `data:` lines separated by blank lines."""
    lines = []
    for chunk in chunks:
        payload = chunk if isinstance(chunk, str) else json.dumps(chunk)
        lines += [f"data: {payload}\n".encode(), b"\n"]
    return lines


def clock_at(*times: float):
    """A clock that reads the given times in turn: one per `data:` line, then the end of the stream."""
    it = iter(times)
    return lambda: next(it)


def chat(content=None, role=None, finish=None) -> dict:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def usage(prompt: int, completion: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def test_chat_stream_timings_follow_vllm_definitions():
    # sent at t=10.0 s; the role-only chunk (0.05 s) and the empty finish chunk are not content; one content
    # chunk carries two tokens, so 4 tokens arrive in 3 content chunks
    stream = sse(chat(role="assistant", content=""), chat("Hel"), chat("lo, wor"), chat("ld"),
                 chat("", finish="length"), usage(7, 4), "[DONE]")
    record = RequestRecord(start=0, endpoint="/v1/chat/completions")
    measure_stream(stream, clock_at(10.05, 10.2, 10.25, 10.4, 10.41, 10.42, 10.43, 10.5), 10.0, record)
    assert record.ttft_ms == pytest.approx(200)                      # first content, not the role chunk
    assert record.itl_ms == pytest.approx([50, 150])                 # gaps between content chunks
    assert record.e2e_ms == pytest.approx(500)                       # until the stream ended
    assert (record.prompt_tokens, record.output_tokens) == (7, 4)    # from usage, not from chunks
    assert record.tpot_ms == pytest.approx((500 - 200) / 3)          # (E2E - TTFT) / (tokens - 1)


def test_tokens_without_visible_text_arrive_at_the_end():
    """Every token's text held back (incomplete UTF-8, say) until the stream ends: TTFT is then E2E."""
    stream = sse(chat(role="assistant", content=""), chat("", finish="length"), usage(5, 3), "[DONE]")
    record = RequestRecord(start=0, endpoint="/v1/chat/completions")
    measure_stream(stream, clock_at(1.1, 1.2, 1.3, 1.4, 1.4), 1.0, record)
    assert record.ttft_ms == pytest.approx(record.e2e_ms) and record.output_tokens == 3 and record.tpot_ms == 0


def test_completion_and_token_id_chunks_count_as_content():
    text = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    ids = {"choices": [{"index": 0, "text": "", "token_ids": [5, 6], "finish_reason": None}]}
    record = RequestRecord(start=0, endpoint="/v1/completions")
    measure_stream(sse(text, ids, ids, "[DONE]"), clock_at(1.1, 1.3, 1.6, 1.7, 1.7), 1.0, record)
    assert record.ttft_ms == pytest.approx(100)
    assert record.itl_ms == pytest.approx([200, 300])
    assert record.output_tokens == 5  # no usage chunk: the ids streamed, one token per text chunk


def test_stream_errors_are_raised_with_the_servers_message():
    error = {"error": {"message": "KV cache exhausted", "type": "server_error"}}
    with pytest.raises(StreamError, match="KV cache exhausted"):
        measure_stream(sse(chat("a"), error), clock_at(1, 2, 3), 0, RequestRecord(0, "/v1/chat/completions"))
    with pytest.raises(StreamError, match=r"without data: \[DONE\]"):
        measure_stream(sse(chat("a")), clock_at(1, 2), 0, RequestRecord(0, "/v1/chat/completions"))


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 997):
        values = [rng.expovariate(1 / 20) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) is None


def test_slo_parsing():
    assert parse_slo("ttft:500ms, tpot:50ms,e2e:2.5s") == {"ttft": 500, "tpot": 50, "e2e": 2500}
    assert parse_slo("ttft:300") == {"ttft": 300}
    for bad in ("ttft", "latency:5ms", "ttft:fast", "tpot:5min"):
        with pytest.raises(ValueError, match="bad SLO"):
            parse_slo(bad)


def test_goodput_counts_successful_requests_within_every_slo():
    def rec(ttft, e2e, tokens, error=""):
        return RequestRecord(start=0, endpoint="/v1/completions", error=error, output_tokens=tokens, ttft_ms=ttft,
                             e2e_ms=e2e, itl_ms=[(e2e - ttft) / max(tokens - 1, 1)] * (tokens - 1))

    records = [rec(100, 1090, 100),          # TTFT 100, TPOT 10: good
               rec(600, 1000, 5),            # TTFT over the SLO
               rec(100, 2080, 100),          # TPOT 20: over
               rec(400, 400, 1),             # one token: TPOT counts as 0, good
               rec(50, 60, 2, "HTTP 503: queue full")]  # failed: never good
    summary = summarize(records, duration_s=2.0, slo=parse_slo("ttft:500ms,tpot:15ms"))
    assert (summary.completed, summary.failed) == (4, 1)
    assert summary.goodput == pytest.approx(2 / 2.0)
    assert summary.request_throughput == pytest.approx(4 / 2.0)
    assert summary.output_throughput == pytest.approx((100 + 5 + 100 + 1) / 2.0)
    assert summary.latency_ms["ttft"][50] == pytest.approx(np.percentile([100, 600, 100, 400], 50))
    assert summary.latency_ms["tpot"][50] == pytest.approx(np.percentile([10, 100, 20], 50))
    gaps = [gap for r in records[:4] for gap in r.itl_ms]  # ITL pools the gaps of every successful request
    assert summary.latency_ms["itl"][99] == pytest.approx(np.percentile(gaps, 99))


# ---- real runs against a real server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_server():
    server = Server("--demo")
    yield server
    server.stop()


def locust(server: Server, prefix: Path, *options: str) -> subprocess.CompletedProcess:
    """A bounded headless Locust run of loadtest/locustfile.py (every run stops by --run-time or --max-requests)."""
    cmd = [sys.executable, "-m", "locust", "-f", str(LOADTEST / "locustfile.py"), "--host", server.url, "--headless",
           "--only-summary", "--csv", str(prefix), *options]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=prefix.parent,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def locust_stats(prefix: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


@pytest.fixture(scope="module")
def closed_loop_run(demo_server, tmp_path_factory):
    """The CI run of the issue: 4 users for 10 s, fixed output length."""
    prefix = tmp_path_factory.mktemp("closed") / "u4"
    result = locust(demo_server, prefix, "-u", "4", "-r", "4", "-t", "10s", "--prompt-tokens", "8:24",
                    "--output-tokens", "8", "--ignore-eos")
    assert result.returncode == 0, result.stderr[-3000:]
    return prefix


def test_headless_run_has_zero_failures_and_ttft_itl_tpot_rows(closed_loop_run):
    stats = locust_stats(closed_loop_run)
    post = stats[("POST", "/v1/completions")]
    assert int(post["Request Count"]) > 0 and int(post["Failure Count"]) == 0
    records = read_records(f"{closed_loop_run}_llm_requests.csv")
    assert all(r.ok for r in records)
    # Locust's last CSV write can miss the requests of its final moments (at most one per user), which the
    # per-request file keeps; Locust's rows hold one TTFT and one TPOT per request it counted
    counted = int(post["Request Count"])
    assert len(records) - 4 <= counted <= len(records)
    assert int(stats[("TTFT", "/v1/completions")]["Request Count"]) == counted
    assert int(stats[("TPOT", "/v1/completions")]["Request Count"]) == counted
    assert int(stats[("ITL", "/v1/completions")]["Request Count"]) > 0
    assert float(post["Average Content Size"]) == 8  # the POST row's size is output tokens
    for r in records:
        assert r.output_tokens == 8  # ignore_eos + min_tokens: exact lengths
        assert 0 < r.ttft_ms <= r.ttft_ms + sum(r.itl_ms) <= r.e2e_ms
        assert len(r.itl_ms) <= 7  # a chunk may carry several tokens, never fewer than one
    run = json.loads(Path(f"{closed_loop_run}_llm_run.json").read_text())
    assert run["users"] == 4 and run["stop"] > run["start"]


def test_report_writes_table_json_and_png(closed_loop_run, tmp_path):
    out = tmp_path / "report"
    result = subprocess.run([sys.executable, str(LOADTEST / "report.py"), str(closed_loop_run),
                             "--slo", "ttft:60s,tpot:60s", "--out", str(out)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    records = read_records(f"{closed_loop_run}_llm_requests.csv")
    header, rule, row = result.stdout.strip().splitlines()
    assert "TTFT p50/p90/p99 ms" in header and "ITL p50/p90/p99 ms" in header and "TPOT p50/p90/p99 ms" in header
    assert row.startswith(f"| 4 users | {len(records)} | 0 |")
    assert (out / "report.md").read_text().startswith(header)
    summary = json.loads((out / "report.json").read_text())["runs"][0]["summary"]
    # every request meets SLOs of a minute, so goodput equals the request rate
    assert summary["request_throughput"] > 0 and summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert summary["latency_ms"]["ttft"]["50"] == pytest.approx(np.percentile([r.ttft_ms for r in records], 50))
    png = (out / "latency.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_server_errors_are_failures_with_the_servers_message(demo_server, tmp_path):
    # token ids beyond the demo model's 512-entry vocabulary: every request gets a 400
    result = locust(demo_server, tmp_path / "bad", "-u", "1", "-r", "1", "-t", "20s", "--token-ids",
                    "--vocab-size", "100000", "--max-requests", "5")
    assert result.returncode == 1, result.stderr[-3000:]  # Locust's exit code when requests failed
    with open(tmp_path / "bad_failures.csv", newline="") as f:
        failures = list(csv.DictReader(f))
    # one row per distinct message (each names the offending id), all from the completions endpoint
    assert failures and {(f["Method"], f["Name"]) for f in failures} == {("POST", "/v1/completions")}
    assert all(f["Error"].startswith("HTTP 400: ") and "512" in f["Error"] for f in failures)
    records = read_records(f"{tmp_path / 'bad'}_llm_requests.csv")
    assert len(records) == 5 and all(r.status == 400 and not r.ok for r in records)
    assert httpx.get(f"{demo_server.url}/health", timeout=10).status_code == 200


def test_open_loop_token_ids_overlap_requests_from_one_user(demo_server, tmp_path):
    # one user, arrivals at 1000 req/s capped at 4 in flight: requests overlap, which a closed-loop user never does
    result = locust(demo_server, tmp_path / "open", "-u", "1", "-r", "1", "-t", "30s", "--request-rate", "1000",
                    "--max-concurrency", "4", "--max-requests", "8", "--token-ids", "--vocab-size", "512",
                    "--prompt-tokens", "20", "--output-tokens", "16", "--ignore-eos")
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_records(f"{tmp_path / 'open'}_llm_requests.csv")
    assert len(records) == 8 and all(r.ok for r in records)
    assert {(r.prompt_tokens, r.output_tokens) for r in records} == {(20, 16)}  # token ids: exact prompt lengths
    spans = sorted((r.start, r.start + r.e2e_ms / 1000) for r in records)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))


def test_shared_prefix_hits_the_radix_cache(demo_server, tmp_path):
    def cache_hits() -> int:
        return demo_server.info()["scheduler"]["cache_hit_tokens"]

    before = cache_hits()
    result = locust(demo_server, tmp_path / "prefix", "-u", "1", "-r", "1", "-t", "30s", "--endpoint", "chat",
                    "--shared-prefix", "64", "--prompt-tokens", "4", "--output-tokens", "4", "--max-requests", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_records(f"{tmp_path / 'prefix'}_llm_requests.csv")
    assert len(records) == 4 and all(r.ok and r.prompt_tokens > 64 for r in records)
    # one user, one request at a time: the 2nd..4th find the 64-word prefix (>= 64 tokens) cached
    assert cache_hits() - before >= 3 * 64


# ---- the in-cluster Job ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def k8s_manifests() -> dict[str, dict]:
    """`kubectl kustomize loadtest/` (what `kubectl apply -k loadtest/` sends), by kind."""
    rendered = subprocess.run(["kubectl", "kustomize", str(LOADTEST)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    return {doc["kind"]: doc for doc in yaml.safe_load_all(rendered.stdout)}


def test_k8s_job_and_configmap_validate_for_current_kubernetes(k8s_manifests):
    assert sorted(k8s_manifests) == ["ConfigMap", "Job"]
    for manifest in k8s_manifests.values():
        kubernetes_validate.validate(manifest, "1.30.0", strict=True)
    config_map, pod = k8s_manifests["ConfigMap"], k8s_manifests["Job"]["spec"]["template"]["spec"]
    for name in ("locustfile.py", "stream_metrics.py", "report.py"):  # the scripts themselves, not copies
        assert config_map["data"][name] == (LOADTEST / name).read_text()
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["loadtest"]["configMap"]["name"] == config_map["metadata"]["name"]


def test_k8s_job_command_runs_against_a_server(k8s_manifests, demo_server, tmp_path):
    """The Job's container command and environment, run as a local process: /loadtest is the repo's loadtest/,
    /results a temporary folder, the Service the demo server, and a shorter, smaller load."""
    container = k8s_manifests["Job"]["spec"]["template"]["spec"]["containers"][0]
    script = container["args"][0].replace("/loadtest/", f"{LOADTEST}/").replace("/results", str(tmp_path))
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e},
           "LOCUST_HOST": demo_server.url, "LOCUST_RUN_TIME": "4s", "LOCUST_USERS": "2", "LOCUST_SPAWN_RATE": "2",
           "LOCUST_PROMPT_TOKENS": "16", "LOCUST_OUTPUT_TOKENS": "6", "SLO": "ttft:60s",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(container["command"] + [script], capture_output=True, text=True, env=env, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| 2 users |" in result.stdout and "== report.json" in result.stdout
    assert "POST,/v1/completions," in result.stdout  # Locust's stats CSV in the log
    records = read_records(f"{tmp_path}/run_llm_requests.csv")
    assert records and all(r.ok and r.output_tokens == 6 for r in records)
    assert json.loads((tmp_path / "run_llm_run.json").read_text())["workload"]["ignore_eos"] is True  # from env


def test_dataset_prompts_and_their_output_lengths(demo_server, tmp_path):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Hi!"}], "output_tokens": 3}) + "\n\n" +
                       json.dumps({"prompt": "Tell me a story", "output_tokens": 5}) + "\n")
    result = locust(demo_server, tmp_path / "data", "-u", "2", "-r", "2", "-t", "30s", "--endpoint", "chat",
                    "--dataset", str(dataset), "--ignore-eos", "--max-requests", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_records(f"{tmp_path / 'data'}_llm_requests.csv")
    assert len(records) == 4 and all(r.ok and r.endpoint == "/v1/chat/completions" for r in records)
    assert {r.output_tokens for r in records} <= {3, 5}  # each line's own output length


@pytest.mark.parametrize("options, message", [
    (["--token-ids", "--endpoint", "chat"], "--token-ids needs --endpoint completions"),
    (["--prompt-tokens", "10:5"], "--prompt-tokens must be positive with A <= B"),
    (["--dataset", "/nonexistent.jsonl"], "No such file"),
])
def test_bad_options_stop_before_any_request(tmp_path, options, message):
    # nothing listens on port 9: a run that sent requests would fail them, not exit 2 with the reason
    result = subprocess.run([sys.executable, "-m", "locust", "-f", str(LOADTEST / "locustfile.py"), "--headless",
                             "--host", "http://127.0.0.1:9", "-t", "5s", *options], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2 and message in result.stderr
