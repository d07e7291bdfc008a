"""No single request can kill, stall or 500 the server (issue 11): a real server over real sockets, tried as
a hostile client would: the requests that used to crash it, every parameter at its extremes, a body too
large, a prompt that takes seconds to tokenize, a missing key, a burst past the queue limit, SIGTERM with
requests that outlive --shutdown-timeout, and schemathesis against the server's own openapi.json."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import select
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
from schemathesis.core.warnings import SchemathesisWarning
from server_fixtures import Server, long_context_copy, pages_all_free, serving

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "hi"}]
VOCAB = 512  # the tiny model's


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models["qwen3"]


@pytest.fixture(scope="module")
def server(model):
    """Guarded by an API key, with a short context so that every generation the tests start is short."""
    with serving(model, "--max-seq-len", "64", api_key=KEY) as srv:
        yield srv


def post(server: Server, path: str, body, **kwargs) -> httpx.Response:
    content = json.dumps(body, allow_nan=True) if not isinstance(body, bytes) else body
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers=AUTH | {"content-type": "application/json"}, **kwargs)


def wait_pages_free(server: Server) -> None:
    deadline = time.monotonic() + 30
    while not pages_all_free(server.info()):
        assert time.monotonic() < deadline, server.info()["scheduler"]
        time.sleep(0.05)


# ---------------------------------------------------------------- the requests that broke the server

FROM_THE_ISSUE = [  # (path, body, param): each used to kill a process or answer 500; now a 400 naming the field
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop_token_ids": [VOCAB + 1000], "min_tokens": 2},
     "stop_token_ids"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "stop_token_ids": [2**70], "min_tokens": 1},
     "stop_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "\ud800"}, "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/v1/chat/completions", {"model": "\ud800", "messages": CHAT}, "model"),
    ("/tokenize", {"prompt": "a\udfff"}, "prompt"),
    ("/detokenize", {"tokens": [2**70]}, "tokens"),
    ("/detokenize", {"tokens": [VOCAB]}, "tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "3"}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": "1"}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": "no"}, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": [[1, 2], [2**70]]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {str(2**70): 1}}, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": float("nan")}, "temperature"),
]


@pytest.mark.parametrize("path, body, param", FROM_THE_ISSUE)
def test_requests_that_crashed_the_server_get_a_400_naming_the_field(server, path, body, param):
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and resp.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tokenize_takes_a_prompt_or_messages_not_both(server):
    """Found by schemathesis: a body matching both shapes was tokenized as a chat, its prompt ignored."""
    resp = post(server, "/tokenize", {"prompt": "", "messages": CHAT})
    assert resp.status_code == 400 and "not both" in resp.json()["error"]["message"], resp.text


def extreme_requests() -> list[tuple[str, dict]]:
    """One request per (field, extreme value), the rest of it ordinary."""
    huge_ids = list(range(VOCAB)) * 20
    extremes = {
        "ints": [2**70, -2**70, 2**63 - 1, -1, 0, 1],
        "floats": [1e308, -1e308, 5e-324, 0.0, 2.0, -2.0],
        "ids": [[], [2**70], [-1], [VOCAB], [VOCAB - 1], huge_ids],
    }
    fields = {"n": "ints", "seed": "ints", "top_k": "ints", "min_tokens": "ints", "max_tokens": "ints",
              "logprobs": "ints", "temperature": "floats", "top_p": "floats", "min_p": "floats",
              "presence_penalty": "floats", "frequency_penalty": "floats", "repetition_penalty": "floats",
              "stop_token_ids": "ids", "prompt": "ids"}
    base = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
    requests = [("/v1/completions", base | {field: value})
                for field, kind in fields.items() for value in extremes[kind]]
    requests += [("/v1/completions", base | {"prompt": [huge_ids[:40]] * 16, "n": 16}),
                 ("/v1/completions", base | {"stop": ["x" * 10000] * 16}),
                 ("/v1/chat/completions", {"model": "tiny", "messages": CHAT * 500, "max_tokens": 2}),
                 ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "top_logprobs": 20, "logprobs": True,
                                           "max_completion_tokens": 2**70, "min_tokens": 2**70}),
                 ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "temperature": 5e-324, "top_p": 5e-324,
                                           "repetition_penalty": 5e-324, "min_p": 1.0, "max_tokens": 2})]
    return requests


def test_every_parameter_at_its_extremes_gets_200_or_400_and_pages_return(server):
    for path, body in extreme_requests():
        resp = post(server, path, body)
        assert resp.status_code in (200, 400), (body, resp.text)
        if resp.status_code == 400:
            assert resp.json()["error"]["param"] in body, (body, resp.text)
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_pages_free(server)


# ---------------------------------------------------------------- the event loop never blocks


def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    rng = random.Random(0)  # distinct words: a repeated text would be served from the tokenizer's word cache
    prompt = " ".join("".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(430_000))  # 3 MB
    big = concurrent.futures.ThreadPoolExecutor(1).submit(
        post, server, "/v1/completions", {"model": "tiny", "prompt": prompt})
    deadline = time.monotonic() + 60
    while server.info()["preparing"] == 0:  # each answer here already proves the loop is free
        assert not big.done() and time.monotonic() < deadline, big.result().text if big.done() else "no start"
        time.sleep(0.01)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.info()["preparing"] == 1 and not big.done()  # /health was answered during the tokenization
    error = big.result().json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"


# ---------------------------------------------------------------- the body size limit


def raw_exchange(port: int, head: str, chunks: list[bytes]) -> tuple[int, dict]:
    """Send a request head, then body chunks only while no answer has come; return (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode())
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head_bytes, body = data.split(b"\r\n\r\n", 1)
        lines = head_bytes.decode().split("\r\n")
        length = int(next(line.split(":")[1] for line in lines if line.lower().startswith("content-length")))
        while len(body) < length:
            body += sock.recv(65536)
        return int(lines[0].split()[1]), json.loads(body)


def test_a_body_over_the_limit_gets_413_before_it_is_read(server):
    limit = 4 * 1024 * 1024
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {limit + 1}\r\n\r\n")
    status, body = raw_exchange(server.port, head, [])  # not one byte of the body was sent
    assert status == 413 and body["error"]["code"] == "request_too_large" and str(limit) in body["error"]["message"]
    chunked = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
               "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    mib = b" " * (1024 * 1024)
    status, body = raw_exchange(server.port, chunked, [b"100000\r\n" + mib + b"\r\n"] * 8)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server.url}/health").status_code == 200


# ---------------------------------------------------------------- the API key and the HTTP contract


def test_the_api_key_guards_every_route_but_the_probes(server):
    schema = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
    routes = [(method, path) for path, ops in schema["paths"].items() for method in ops]
    routes += [("get", "/openapi.json"), ("get", "/docs"), ("get", "/no/such/path")]
    assert ("post", "/tokenize") in routes and ("get", "/get_server_info") in routes
    for method, path in routes:
        open_path = path in ("/health", "/metrics")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            resp = httpx.request(method, f"{server.url}{path}", headers=headers, json={})
            assert (resp.status_code != 401) if open_path else (resp.status_code == 401), (method, path, headers)
            if not open_path:
                assert resp.json()["error"]["code"] == "invalid_api_key" and resp.headers["www-authenticate"]
    assert httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": "hi"}).status_code == 200
    assert httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"bearer {KEY}"},
                      json={"prompt": "hi"}).status_code == 200  # the scheme is case-insensitive (RFC 7235)


def test_405_says_which_methods_are_allowed(server):
    resp = httpx.put(f"{server.url}/v1/completions", headers=AUTH)
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    assert resp.json()["error"]["message"]
    # GET and DELETE of a stored response are two routes: Allow names both, not only the first route's method
    resp = httpx.put(f"{server.url}/v1/responses/resp_1", headers=AUTH)
    assert resp.status_code == 405 and resp.headers["allow"] == "DELETE, GET"


def test_openapi_declares_what_the_server_answers(server):
    schema = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "500", "503"} <= set(responses) and "422" not in responses
        for status in ("400", "401", "404", "413", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == error_ref
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert schema["paths"][path]["post"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/health"]["get"]
    operation_ids = [operation["operationId"] for operations in schema["paths"].values()
                     for operation in operations.values()]
    assert len(operation_ids) == len(set(operation_ids))
    assert "Duplicate Operation ID" not in server.output()  # FastAPI's own ids are unique, not renamed afterwards
    for path, operations in schema["paths"].items():  # a fault in any handler, a body too large for any POST
        for method, operation in operations.items():
            for status in ("500", "413") if method == "post" else ("500",):
                assert operation["responses"][status]["content"]["application/json"]["schema"] == error_ref, path
            for link in operation["responses"]["200"].get("links", {}).values():
                assert link["operationId"] in operation_ids, link
    assert len(schema["paths"]["/v1/responses"]["post"]["responses"]["200"]["links"]) == 5  # 4 routes, a next turn
    assert schema["paths"]["/tokenize"]["post"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/TokenizeResponse"}
    completion = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["model"]["enum"] == ["tiny"]
    assert completion["stop_token_ids"]["anyOf"][0]["items"] == {"type": "integer", "minimum": 0, "maximum": VOCAB - 1}
    assert "ChatCompletionChunk" in schema["components"]["schemas"]


STREAMED = [("/v1/chat/completions", {"messages": CHAT, "n": 2, "logprobs": True, "top_logprobs": 2,
                                      "prompt_logprobs": 1, "return_token_ids": True}),
            ("/v1/completions", {"prompt": [[5, 6], [7]], "echo": True, "logprobs": 2, "prompt_logprobs": 1,
                                 "return_token_ids": True}),
            ("/generate", {"text": ["hi", "yo"], "sampling_params": {"n": 2, "max_new_tokens": 3}}),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 3, "include": ["message.output_text.logprobs"],
                               "top_logprobs": 2})]
LENGTH = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens"}
USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def server_sent_events(text: str) -> list[dict[str, str]]:
    """A stream's events as their fields (`event`, `data`)."""
    return [dict(line.split(": ", 1) for line in block.splitlines()) for block in text.split("\n\n") if block.strip()]


@pytest.mark.parametrize("path, body", STREAMED)
def test_streamed_events_and_whole_answers_match_openapi(server, path, body):
    """What schemathesis cannot check: each event of a stream is the one openapi.json declares for it (its
    data the chunk, error or Responses event), and the whole answer to the same body its 200 schema (SSE's
    contentSchema is an annotation that a JSON Schema validator does not apply, so the payload is checked here)."""
    spec = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
    declared = spec["paths"][path]["post"]["responses"]["200"]["content"]

    def valid(schema: dict, value) -> None:
        jsonschema.Draft202012Validator({**schema, "components": spec["components"]}).validate(value)

    body = body | ({LENGTH[path]: 3} if path in LENGTH else {})
    whole = post(server, path, body)
    assert whole.status_code == 200, whole.text
    valid(declared["application/json"]["schema"], whole.json())
    streamed = post(server, path, body | {"stream": True} | (USAGE if path in LENGTH else {}))
    events = server_sent_events(streamed.text)
    assert streamed.status_code == 200 and len(events) > 2, streamed.text
    schema = declared["text/event-stream"]["schema"]
    data = schema["properties"]["data"]
    payload = next(branch["contentSchema"] for branch in data.get("anyOf", [data]) if "contentSchema" in branch)
    for event in events:
        valid(schema, event)
        if event["data"] != "[DONE]":
            valid(payload, json.loads(event["data"]))
            assert json.loads(event["data"]).get("type") == event.get("event")  # named framing: both say it


# Every warning schemathesis shows by default but these: the ids of stored responses (GET, DELETE, cancel,
# input_items of /v1/responses/{id}) cannot be guessed, and a 404 for an unknown id is the contract
# (missing_test_data); chat's many cross-field refusals (a 400 naming the field, each pinned by
# tests/e2e/test_every_field.py) reject most random bodies (low_valid_rate, validation_mismatch).
FUZZ_EXAMPLES = 40  # per operation and phase: about two minutes on two CPU cores
WARNINGS = [warning.value for warning in SchemathesisWarning
            if warning not in (SchemathesisWarning.MISSING_TEST_DATA, SchemathesisWarning.LOW_VALID_RATE,
                               SchemathesisWarning.VALIDATION_MISMATCH)]


def schemathesis(srv: Server, cwd: Path, *selection: str) -> str:
    """Every schemathesis check (response schema conformance included; positive_data_acceptance made exact by
    tests/schemathesis_hooks.py) on the operations `selection` picks (all by default); its output, once it found
    no issue and tested every operation it selected."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{srv.url}/openapi.json", "-H",
           f"Authorization: Bearer {KEY}", "--checks", "all", "--exclude-checks", "positive_data_acceptance",
           "--max-examples", str(FUZZ_EXAMPLES), "--max-response-time", "60", "--request-timeout", "60",
           "-w", "1", "--seed", "11", "--generation-database", "none",  # the seed alone decides the run
           "--output-truncate", "true", "--output-sanitize", "false", "--warnings", ",".join(WARNINGS), *selection]
    tests = os.path.dirname(os.path.dirname(__file__))  # where schemathesis_hooks.py is
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=420)  # its caches go there
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "No issues found" in run.stdout, run.stdout[-4000:]
    operations, tested = (re.search(pattern, run.stdout) for pattern in (r"Selected: (\d+)/", r"Tested: (\d+)"))
    assert operations and tested and operations[1] == tested[1], run.stdout[-2000:]
    return run.stdout


def test_schemathesis_finds_no_5xx_and_no_contract_violation(model, tmp_path):
    """schemathesis on every operation of the server's own openapi.json, in every phase, against a server with
    the model's whole context: the hooks bound a generation's length, as only the fuzzer needs. Then the
    stateful phase once more on the Responses routes alone: on all of them it starts from the routes that list
    (GET /v1/models), never from POST /v1/responses, whose previous_response_id it takes for an id nothing
    creates; alone it creates responses and follows every link with their real ids: to their stored routes,
    and to a next turn (previous_response_id)."""
    with serving(model, api_key=KEY) as srv:
        everything = schemathesis(srv, tmp_path)
        assert re.search(r"Selected: (\d+)/\1\b", everything), everything[-2000:]  # every route
        stored = schemathesis(srv, tmp_path, "--phases", "stateful", "--include-path-regex", "^/v1/responses")
        links = re.search(r"API Links: +(\d+) covered / (\d+) selected", stored)
        assert links and links[1] == links[2] == "5", stored[-2000:]
        wait_pages_free(srv)


# ---------------------------------------------------------------- limits that hold


def test_a_burst_past_the_queue_limit_is_admitted_only_up_to_it(model, tmp_path):
    # the long request must still hold the running slot when the whole burst has arrived: at the tiny model's
    # 2,048 positions it could finish first on a loaded machine, and its freed slot admitted more than 2. The pool
    # bounds it too: in the fixture's 4,096 pages it ended ("length") after ~4,000 tokens, a few seconds, which a
    # loaded CI machine's burst outlasted twice; 131,072 pages let it run to its 65,536 positions
    srv = Server(long_context_copy(model, tmp_path, 65536), "--max-queued-requests", "2",
                 "--max-running-requests", "1", "--num-pages", "131072")
    try:
        room = srv.info()["max_seq_len"] - 2  # as long as the context allows (beyond it is a 400)
        long = {"model": "tiny", "prompt": [5, 6], "max_tokens": room, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=long, timeout=60) as running:
            lines = running.iter_lines()  # kept: a discarded iterator closes the stream
            next(lines)  # it has its first token: it holds the only running slot, and no queue place
            short = {"model": "tiny", "prompt": "wait", "max_tokens": 2, "ignore_eos": True}
            barrier = threading.Barrier(40)

            def send() -> httpx.Response:
                barrier.wait()
                return httpx.post(f"{srv.url}/v1/completions", json=short, timeout=60)

            with concurrent.futures.ThreadPoolExecutor(40) as pool:
                burst = [pool.submit(send) for _ in range(40)]
                deadline = time.monotonic() + 60
                while sum(f.done() for f in burst) < 38:  # the refusals come at once; the admitted wait
                    assert time.monotonic() < deadline, [f.result().status_code for f in burst if f.done()]
                    time.sleep(0.05)
                refused = [f.result() for f in burst if f.done()]
                assert [r.status_code for r in refused] == [503] * 38 and all(r.headers["retry-after"] for r in refused)
                assert srv.info()["scheduler"]["num_waiting"] == 2
                running.close()  # the long request is aborted; the two admitted ones run
                assert sorted(f.result().status_code for f in burst) == [200] * 2 + [503] * 38
    finally:
        assert srv.stop() == 0


def test_shutdown_timeout_is_a_hard_bound(model, tmp_path):
    # the stream must still run when the signal comes, after the crowd is in: 12,000 tokens (a longer context
    # and a pool for them and the crowd), since 2,000 could end first on a loaded machine
    srv = Server(long_context_copy(model, tmp_path, 16384), "--shutdown-timeout", "1", "--num-pages", "65536")
    stream_body = {"model": "tiny", "prompt": "on and on", "max_tokens": 12000, "ignore_eos": True, "stream": True}
    crowd = {"model": "tiny", "prompt": [[5, 6, 7]] * 16, "n": 16, "max_tokens": 2000, "ignore_eos": True}
    events: list[str] = []
    streaming = threading.Event()  # the stream request itself runs: it has sent its first event

    def stream() -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=stream_body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    streaming.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(timeout=30)
    whole = concurrent.futures.ThreadPoolExecutor(1).submit(
        httpx.post, f"{srv.url}/v1/completions", json=crowd, timeout=120)
    deadline = time.monotonic() + 30
    while sum(srv.info()["scheduler"][k] for k in ("num_running", "num_waiting")) < 1 + 16:  # all 16 crowd seqs in
        assert time.monotonic() < deadline
        time.sleep(0.02)
    srv.proc.send_signal(signal.SIGTERM)
    thread.join(timeout=60)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "service_unavailable"
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])  # cut short, not finished
    resp = whole.result()
    assert resp.status_code == 503 and resp.json()["error"]["message"] == "the server is shutting down"
    assert srv.proc.wait(timeout=30) == 0
    assert "shutdown timeout: failing" in srv.output()
