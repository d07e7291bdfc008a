"""The server end to end: a real process, real sockets, the real `openai` client."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest
from helpers import make_llm
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import Server, long_context_copy, metric_samples, pages_all_free, serving
from transformers import AutoTokenizer

from minisgl import SamplingParams

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about caches. 🙂"}]


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models["qwen3"]


@pytest.fixture(scope="module")
def server(model):
    with serving(model, "--max-queued-requests", "64") as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(model):
    return AutoTokenizer.from_pretrained(model)


def template_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
                   for c in chunks if c.choices)
    return text, chunks


def test_completions_every_prompt_shape(client, tokenizer):
    ids = tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    base = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    from_text = client.completions.create(prompt="Once upon a time", **base)
    from_ids = client.completions.create(prompt=ids, **base)
    batch = client.completions.create(prompt=["Once upon a time", "Hello"], **base)
    id_batch = client.completions.create(prompt=[ids, tokenizer("Hello")["input_ids"]], **base)
    assert from_text.choices[0].text == from_ids.choices[0].text == batch.choices[0].text
    assert [c.text for c in batch.choices] == [c.text for c in id_batch.choices]
    assert [c.index for c in batch.choices] == [0, 1]
    streamed, _ = stream_text(client.completions.create(prompt="Once upon a time", stream=True, **base))
    assert streamed == from_text.choices[0].text
    assert from_text.usage.prompt_tokens == len(ids) and batch.usage.completion_tokens == 16


def test_32_concurrent_streams_equal_offline_greedy(client, model, tokenizer):
    conversations = [[{"role": "user", "content": f"Request number {i}: say something {'long ' * (i % 7)}"}]
                     for i in range(32)]

    def run(messages):
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        return stream_text(stream)[0]

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(run, conversations))
    llm = make_llm(model)
    offline = llm.generate([template_ids(tokenizer, m) for m in conversations],
                           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert texts == [o.text for o in offline]


def test_n_with_seed_is_reproducible(client):
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=16, temperature=1.0, n=3, seed=42)
    first = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    second = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    assert first == second and len(set(first)) > 1


def test_stop_strings_are_cut_across_tokens(client):
    base = dict(model="tiny", prompt="The weather today is", max_tokens=30, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**base).choices[0].text
    stop = full[7:10]  # three characters in the middle, likely spanning a token boundary
    cut = client.completions.create(**base, stop=[stop, "never appears"])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed, _ = stream_text(client.completions.create(**base, stop=stop, stream=True))
    assert streamed == cut.choices[0].text


BAD_REQUESTS = [  # (path, body or raw bytes, status, param)
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "top_k": -2}, 400, "top_k"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "presence_penalty": 5}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "top_logprobs": 30, "logprobs": True}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": None, "messages": CHAT}, 400, "model"),  # left out: the served model
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "word " * 3000}]}, 400,
     "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 10**7]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/tokenize", {"messages": [{"role": "", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_invalid_requests_get_clear_errors(server, path, body, status, param):
    start = time.monotonic()
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    resp = httpx.post(f"{server.url}{path}", timeout=2, **kwargs)
    assert time.monotonic() - start < 2
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if param == "messages" and "word" in json.dumps(body):
        assert "2048" in error["message"] and "tokens" in error["message"]  # both lengths are stated


def test_server_healthy_and_no_leak_after_errors(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 200
    assert pages_all_free(server.info())


def generated_tokens(server) -> float:
    """Tokens of finished requests (aborted ones included) so far, from /metrics."""
    return metric_samples(server)["sglang:generation_tokens_total"]


def wait_until_cut_short(server, before: float, max_tokens: int) -> None:
    """Every page is free again and the request counted fewer tokens than it asked: it was aborted. One run to
    its end frees its pages too, but adds max_tokens to the count; so the wait can be generous for a loaded
    machine (no timed assertion)."""
    deadline = time.monotonic() + 30
    while not pages_all_free(server.info()):
        assert time.monotonic() < deadline, server.info()["scheduler"]
        time.sleep(0.05)
    assert generated_tokens(server) - before < max_tokens


LONG_BODY = {"model": "tiny", "prompt": "Go on forever", "max_tokens": 12000, "ignore_eos": True}


@pytest.fixture(scope="module")
def long_server(model, tmp_path_factory):
    """A server whose answers can run 12,000 tokens (~20 s of CPU decoding): still running when a test drops
    them, even on a loaded machine (2,000 once ended before the check)."""
    with serving(long_context_copy(model, tmp_path_factory.mktemp("long"), 16384), "--num-pages", "16384") as srv:
        yield srv


def test_a_dropped_stream_is_aborted(long_server):
    before = generated_tokens(long_server)
    body = LONG_BODY | {"stream": True}
    with httpx.stream("POST", f"{long_server.url}/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
        assert long_server.info()["scheduler"]["num_running"] == 1
    wait_until_cut_short(long_server, before, LONG_BODY["max_tokens"])


def test_a_dropped_non_streaming_request_is_aborted(long_server):
    before = generated_tokens(long_server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{long_server.url}/v1/completions", json=LONG_BODY, timeout=0.5)
    wait_until_cut_short(long_server, before, LONG_BODY["max_tokens"])


FROZEN_METRICS = {
    ("sglang:num_running_reqs", "gauge"), ("sglang:num_queue_reqs", "gauge"), ("sglang:num_used_tokens", "gauge"),
    ("sglang:token_usage", "gauge"), ("sglang:cache_hit_rate", "gauge"), ("sglang:gen_throughput", "gauge"),
    ("sglang:num_retracted_reqs", "gauge"), ("sglang:prompt_tokens", "counter"),
    ("sglang:generation_tokens", "counter"), ("sglang:cached_tokens", "counter"), ("sglang:num_requests", "counter"),
    ("sglang:time_to_first_token_seconds", "histogram"), ("sglang:inter_token_latency_seconds", "histogram"),
    ("sglang:e2e_request_latency_seconds", "histogram"), ("sglang:time_per_output_token_seconds", "histogram"),
}


def test_metrics_parse_and_count_requests(server, client):
    client.completions.create(model="tiny", prompt="count me", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    resp = httpx.get(f"{server.url}/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    assert {(f.name, f.type) for f in families.values()} == FROZEN_METRICS
    samples = {s.name: s for f in families.values() for s in f.samples}
    assert all(s.labels.get("model_name") == "tiny" for f in families.values() for s in f.samples)
    assert samples["sglang:num_requests_total"].value >= 1
    assert samples["sglang:generation_tokens_total"].value >= 3
    assert samples["sglang:time_to_first_token_seconds_count"].value >= 1
    assert samples["sglang:num_running_reqs"].value == 0


def test_tokenize_detokenize_and_models(server, tokenizer):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "héllo wörld"}).json()["tokens"]
    assert ids == tokenizer("héllo wörld", add_special_tokens=False)["input_ids"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"] == "héllo wörld"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == template_ids(tokenizer, CHAT) and chat["max_model_len"] == 2048
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", 2048)]


def test_api_key_is_enforced(model):
    srv = Server(model, "--api-key", "sekret")
    try:
        bad = srv.openai_client("wrong")
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = srv.openai_client("sekret")
        assert good.models.list().data[0].id == "tiny"
        assert httpx.get(f"{srv.url}/health").status_code == 200  # probes need no key
    finally:
        assert srv.stop() == 0
