"""Launch flags as vLLM's and SGLang's users spell them (and as the docs name them), metrics under vLLM's names,
and a context longer than the model's refused at start-up."""

from __future__ import annotations

import inspect
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import DEVICE
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import Server, metric_samples

import minisgl
from minisgl.distributed import free_port
from minisgl.server.args import build_parser, dashed, parse_args
from minisgl.server.launch import DEMO_CONTEXT

# vLLM's series (prometheus_client's parser reports counters without `_total`), as vLLM's V1 engine names
# and types them; dashboards and routers written for vLLM read exactly these.
VLLM_FAMILIES = {
    ("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:num_preemptions", "counter"),
    ("vllm:prompt_tokens", "counter"), ("vllm:generation_tokens", "counter"),
    ("vllm:prefix_cache_queries", "counter"), ("vllm:prefix_cache_hits", "counter"),
    ("vllm:request_success", "counter"), ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"), ("vllm:e2e_request_latency_seconds", "histogram"),
    ("vllm:request_time_per_output_token_seconds", "histogram"), ("vllm:request_prompt_tokens", "histogram"),
    ("vllm:request_generation_tokens", "histogram"), ("vllm:iteration_tokens_total", "histogram"),
    ("vllm:request_queue_time_seconds", "histogram"), ("vllm:request_prefill_time_seconds", "histogram"),
    ("vllm:request_decode_time_seconds", "histogram"), ("vllm:request_inference_time_seconds", "histogram"),
    ("vllm:request_params_n", "histogram"), ("vllm:request_params_max_tokens", "histogram"),
    ("vllm:cache_config_info", "gauge"),
}


@pytest.fixture(scope="module")
def peer_spelled():
    """A server started with vLLM's and SGLang's flag names (the fixtures of their suites pass these)."""
    srv = Server("--demo", "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager",
                 "--gpu-memory-utilization", "0.5", "--max-num-batched-tokens", "256", "--tensor-parallel-size", "1",
                 "--max-payload-size", "2048", "--enable-cache-report", "--enable-prompt-tokens-details",
                 "--no-enable-prefix-caching", "--enable-server-load-tracking", "--enable-chunked-prefill",
                 "--metrics-naming", "vllm",
                 "--enable-force-include-usage", "--return-tokens-as-token-ids")
    yield srv
    assert srv.stop() == 0


def test_vllm_and_sglang_flag_spellings_take_effect(peer_spelled):
    info = peer_spelled.info()
    assert (info["max_seq_len"], info["max_running_requests"], info["cuda_graph_max_bs"], info["memory_ratio"],
            info["max_prefill_tokens"], info["tp_size"], info["cache_type"]) == (512, 8, 0, 0.5, 256, 1, "naive")
    card = httpx.get(f"{peer_spelled.url}/v1/models/demo").json()
    assert card["max_model_len"] == 512


def test_max_payload_size_answers_413(peer_spelled):
    """SGLang test_request_body_validation: a body over --max-payload-size is refused with 413."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "hello " * 400}]}
    response = httpx.post(f"{peer_spelled.url}/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 413 and error["code"] == "request_too_large"
    assert "Payload Too Large" in error["message"]  # what SGLang's test looks for


def test_metrics_under_vllm_names(peer_spelled):
    """vLLM's test_metrics: its series names and types, with values that match what was served."""
    done = httpx.post(f"{peer_spelled.url}/v1/completions", timeout=60, json={
        "model": "demo", "prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}).json()
    families = list(text_string_to_metric_families(httpx.get(f"{peer_spelled.url}/metrics").text))
    assert {(f.name, f.type) for f in families} == VLLM_FAMILIES
    values = {(s.name, s.labels.get("finished_reason")): s.value for f in families for s in f.samples}
    assert all(s.labels["model_name"] == "demo" and s.labels["engine"] == "0" for f in families for s in f.samples)
    assert values[("vllm:prompt_tokens_total", None)] == done["usage"]["prompt_tokens"]
    assert values[("vllm:generation_tokens_total", None)] == 5
    assert values[("vllm:request_success_total", "length")] == 1
    assert values[("vllm:request_generation_tokens_sum", None)] == 5
    # vLLM test_metrics_counts: one step per token (the prefill samples the first), the prompt counted once
    # (whole, when its prefill completes, however much of it the prefix cache held)
    assert values[("vllm:iteration_tokens_total_count", None)] == 5
    assert values[("vllm:iteration_tokens_total_sum", None)] == done["usage"]["prompt_tokens"] + 5
    assert values[("vllm:request_params_n_sum", None)] == 1
    assert values[("vllm:request_params_max_tokens_sum", None)] == 5
    for phase in ("queue", "prefill", "decode", "inference"):
        assert values[(f"vllm:request_{phase}_time_seconds_count", None)] == 1
    assert values[("vllm:request_inference_time_seconds_sum", None)] <= values[
        ("vllm:e2e_request_latency_seconds_sum", None)]
    config = next(s.labels for f in families if f.name == "vllm:cache_config_info" for s in f.samples)
    assert int(config["num_gpu_blocks"]) == peer_spelled.info()["num_pages"] and int(config["block_size"]) > 0


def test_force_include_usage_puts_usage_on_every_chunk(peer_spelled):
    """vLLM test_chat_with_enable_force_include_usage: with --enable-force-include-usage a stream that asks
    for no usage still has it on every chunk, growing, and on a last chunk without choices."""
    client = peer_spelled.openai_client()
    chunks = list(client.chat.completions.create(model="demo", stream=True, max_completion_tokens=4, messages=[
        {"role": "user", "content": "What is the capital of France?"}], extra_body={"ignore_eos": True}))
    assert all(c.usage and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]  # tokens may arrive several to a chunk
    assert counts[0] == 0 and counts[-1] == 4 and all(a < b for a, b in zip(counts[1:], counts[2:]))
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 4


def test_return_tokens_as_token_ids_flag(peer_spelled):
    """vLLM test_return_tokens_as_ids' server flag: every request's logprobs spell tokens `token_id:N` (the ids of
    its answer), as if it had asked with return_tokens_as_token_ids."""
    client = peer_spelled.openai_client()
    text = client.completions.create(model="demo", prompt="Say 'Hello, world! 🎉'", max_tokens=4, logprobs=1,
                                     extra_body={"return_token_ids": True})
    assert text.choices[0].logprobs.tokens == [f"token_id:{i}" for i in text.choices[0].token_ids]
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "🐱"}], max_tokens=4,
                                          logprobs=True, extra_body={"return_token_ids": True})
    assert [t.token for t in chat.choices[0].logprobs.content] == [f"token_id:{i}" for i in chat.choices[0].token_ids]


def running_gauges(server: Server) -> tuple[float, float]:
    """(running requests, KV usage) now, under SGLang's names (vLLM's map to the same gauges)."""
    samples = metric_samples(server)
    return samples["sglang:num_running_reqs"], samples["sglang:token_usage"]


def test_aborted_requests_leave_the_gauges(demo):
    """vLLM test_abort_metrics_reset: requests being generated are counted running and hold KV pages; once
    their clients hang up, both gauges are back to 0 (polled until the aborts are processed). The answers
    are long (12,000 tokens each, about 20 s of the demo's CPU decoding for three, all in the test server's KV
    pool) so that they are still running when the gauges are read; 1,000 tokens once finished first in CI."""
    body = {"model": "demo", "prompt": "Hello my name is", "max_tokens": 12000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=demo.url, timeout=60) as http:
        streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(3)]
        lines = [stream.__enter__().iter_lines() for stream in streams]  # kept: dropping one closes its stream
        assert all(next(events).startswith('data: {"id"') for events in lines)  # a first token each: running
        running, kv_usage = running_gauges(demo)
        assert running == 3 and kv_usage > 0
        for stream in streams:
            stream.__exit__(None, None, None)
    for _ in range(200):
        if running_gauges(demo)[0] == 0:
            break
    assert running_gauges(demo) == (0, 0)


def test_context_length_above_the_models_maximum_is_refused():
    """Asked for a context the model has no positions for, the server says so and does not start
    (it used to lower it silently)."""
    cmd = [sys.executable, "-m", "minisgl", "--demo", "--device", DEVICE, "--context-length", str(DEMO_CONTEXT + 1),
           "--port", str(free_port())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 2
    assert f"--context-length {DEMO_CONTEXT + 1} is longer than this model's maximum of {DEMO_CONTEXT} tokens" \
        in done.stderr


def test_max_total_tokens_sizes_the_kv_pool():
    """SGLang's --max-total-tokens is the pool size in tokens: pages rounded up; with --num-pages, refused."""
    assert parse_args(["--demo", "--max-total-tokens", "1000", "--page-size", "16"]).engine.num_pages == 63
    with pytest.raises(SystemExit):
        parse_args(["--demo", "--max-total-tokens", "1000", "--num-pages", "10"])


def test_grammar_backend_spellings():
    """SGLang's --grammar-backend and vLLM's --structured-outputs-config.backend: xgrammar (what serves
    structured outputs here) is accepted, another backend stops the server with a usage error."""
    for flag in ("--grammar-backend", "--structured-outputs-config.backend"):
        assert parse_args(["--demo", flag, "xgrammar"]).engine.model == "demo"
        with pytest.raises(SystemExit):
            parse_args(["--demo", flag, "outlines"])


def test_dtype_and_tool_flags_as_vllm_spells_them():
    """vLLM's launch commands: --dtype half / float, and --enable-auto-tool-choice (with its parser; without
    one, a usage error as in vLLM)."""
    assert parse_args(["--demo", "--dtype", "half"]).engine.dtype == "float16"
    assert parse_args(["--demo", "--dtype", "float"]).engine.dtype == "float32"
    assert parse_args(["--demo", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]).tool_call_parser
    with pytest.raises(SystemExit):
        parse_args(["--demo", "--enable-auto-tool-choice"])


ROOT = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9._-]*[a-z0-9]")


def documented_flags() -> set[str]:
    """The server flags the docs name: in every `python -m minisgl ...` command of README.md and docs/, and in
    every column of docs/compatibility.md's table of launch flags (bar the cells that say they are not taken)."""
    flags = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for command in re.findall(r"python -m minisgl (.*)", doc.read_text()):
            flags |= set(FLAG.findall(command))
    table = (ROOT / "docs" / "compatibility.md").read_text().split("## Launch flags under the peers' names")[1]
    for line in table.split("\n## ")[0].splitlines():
        flags |= {flag for cell in line.split("|") if "not taken" not in cell for flag in FLAG.findall(cell)}
    return flags


def test_the_flags_the_docs_name_are_the_servers():
    """README's commands and the peers' launch flags in docs/compatibility.md: each one is a flag that
    `python -m minisgl --help` lists (an unknown flag stops the server with a usage error)."""
    taken = {flag for action in build_parser()._actions for flag in action.option_strings}
    documented = documented_flags()
    assert {"--demo", "--model-path", "--max-num-seqs", "--tokenizer-path", "--trust-remote-code"} <= documented
    assert set(dashed(sorted(documented))) - taken == set()  # --max_model_len is --max-model-len, as vLLM has it


def test_readme_names_every_parameter_of_the_offline_llm():
    """README's `LLM(...)` example lists each of its parameters, and no other."""
    section = (ROOT / "README.md").read_text().split("## Offline API")[1]
    example = section[section.index("llm = LLM("):section.index("outs = llm.generate")]
    assert set(re.findall(r"(\w+)=", example)) == set(inspect.signature(minisgl.LLM).parameters) - {"model"}


def test_flags_spelled_with_underscores():
    """vLLM test_simple (Responses) starts its server with `--max_model_len 5000`: vLLM takes a flag's
    underscores as dashes, and so does minisgl (values keep theirs)."""
    args = parse_args(["--demo", "--max_model_len", "512", "--served_model_name=org/my_model"])
    assert args.engine.max_seq_len == 512 and args.served_model_name == "org/my_model"


@pytest.fixture(scope="module")
def behind_proxy():
    """vLLM test_root_path: --root-path /llm, and the API key from VLLM_API_KEY (no --api-key); and vLLM
    test_optional_middleware's --enable-request-id-headers."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_API_KEY", "abc-123")
        srv = Server("--demo", "--root-path", "/llm", "--enable-request-id-headers")
    yield srv
    assert srv.stop() == 0


@pytest.mark.parametrize("prefix", ["", "/llm"])
def test_root_path_and_api_key_from_vllm_env(behind_proxy, prefix):
    """Routes answer with and without the root path; the key read from VLLM_API_KEY is required on both,
    and /health stays open (probes carry no key)."""
    url = f"{behind_proxy.url}{prefix}"
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer abc"}).status_code == 401
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer abc-123"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "demo"
    assert httpx.get(f"{url}/health").status_code == 200
    wrong = httpx.put(f"{url}/v1/responses/resp_1", headers={"Authorization": "Bearer abc-123"})
    assert wrong.status_code == 405 and wrong.headers["allow"] == "DELETE, GET"  # both routes at the path


def test_request_id_headers(behind_proxy, demo):
    """vLLM test_enable_request_id_header / test_custom_request_id_header / test_no_request_id_header: with
    --enable-request-id-headers every response (a 401 too) carries X-Request-Id, the request's own or 32 hex
    digits; without the flag, none."""
    made = httpx.get(f"{behind_proxy.url}/health").headers["X-Request-Id"]
    assert len(made) == 32 and int(made, 16) >= 0
    assert made != httpx.get(f"{behind_proxy.url}/health").headers["X-Request-Id"]
    refused = httpx.get(f"{behind_proxy.url}/v1/models", headers={"X-Request-Id": "Custom"})
    assert refused.status_code == 401 and refused.headers["X-Request-Id"] == "Custom"
    assert "X-Request-Id" not in httpx.get(f"{demo.url}/health").headers


def test_vllm_reasoning_and_scheduling_flags():
    """vLLM test_thinking_token_budget starts its server with --no-async-scheduling (minisgl's overlap
    scheduling, turned off) and --reasoning-config naming Qwen3's markers: accepted when they are the
    reasoning parser's own, a usage error otherwise (they cannot be changed)."""
    assert parse_args(["--demo", "--no-async-scheduling"]).engine.overlap_schedule is False
    markers = '{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}'
    assert parse_args(["--demo", "--reasoning-parser", "qwen3", "--reasoning-config", markers]).reasoning_parser
    for refused in (["--reasoning-parser", "qwen3", "--reasoning-config", '{"reasoning_end_str": "</done>"}'],
                    ["--reasoning-config", markers]):
        with pytest.raises(SystemExit):
            parse_args(["--demo", *refused])


@pytest.mark.parametrize("cap", ["30", "-1"])
def test_max_logprobs_sets_the_cap(cap):
    """vLLM test_logprob_token_ids starts its server with --max-logprobs -1: a cap other than OpenAI's 20, -1
    none but the vocabulary. Chat top_logprobs, completions logprobs and prompt_logprobs may ask for 25
    alternatives; one over the cap is the 400 a schema bound gives, naming the cap."""
    srv = Server("--demo", "--max-logprobs", cap)
    try:
        client = srv.openai_client()
        chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                              logprobs=True, top_logprobs=25)
        assert all(len(token.top_logprobs) == 25 for token in chat.choices[0].logprobs.content)
        text = client.completions.create(model="demo", prompt="Hello there", max_tokens=2, logprobs=25,
                                         extra_body={"prompt_logprobs": 25})
        assert all(len(top) in (25, 26) for top in text.choices[0].logprobs.top_logprobs)  # + the sampled token
        assert all(len(position) in (25, 26) for position in text.choices[0].prompt_logprobs[1:])
        vocab = srv.info()["vocab_size"]
        over = 31 if cap == "30" else vocab + 1
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                           logprobs=True, top_logprobs=over)
        assert refused.value.body["param"] == "top_logprobs"
        assert f"less than or equal to {over - 1}" in refused.value.body["message"]
        schema = httpx.get(f"{srv.url}/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]
        assert {"type": "integer", "minimum": 0, "maximum": over - 1} in schema["properties"]["top_logprobs"]["anyOf"]
        if cap == "-1":  # the whole vocabulary: every token's probability, summing to 1
            whole = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=1, logprobs=True, top_logprobs=vocab)
            top = whole.choices[0].logprobs.content[0].top_logprobs
            assert len(top) == vocab and sum(math.exp(t.logprob) for t in top) == pytest.approx(1, abs=1e-3)
    finally:
        assert srv.stop() == 0


def test_logprobs_over_the_default_cap_are_refused(client):
    """vLLM test_too_many_chat_logprobs, test_too_many_completion_logprobs: without --max-logprobs the cap is
    OpenAI's 20."""
    for ask in (lambda: client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                                       max_tokens=1, logprobs=True, top_logprobs=21),
                lambda: client.completions.create(model="demo", prompt="Hi", max_tokens=1, logprobs=21),
                lambda: client.completions.create(model="demo", prompt="Hi", max_tokens=1,
                                                  extra_body={"prompt_logprobs": 21})):
        with pytest.raises(openai.BadRequestError) as refused:
            ask()
        assert "less than or equal to 20" in refused.value.body["message"]


def test_serves_on_a_unix_domain_socket(tmp_path):
    """vLLM test_uds: with --uds PATH the server answers on that socket (here /version and a completion), not
    on a TCP port."""
    socket_path = tmp_path / "minisgl.sock"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minisgl", "--demo", "--device", DEVICE, "--uds", str(socket_path),
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path)), base_url="http://minisgl",
                          timeout=60) as http:
            for _ in range(600):
                assert proc.poll() is None, "the server exited"
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            assert http.get("/version").json() == {"version": minisgl.__version__}
            done = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).json()
            assert done["usage"]["completion_tokens"] >= 1
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
