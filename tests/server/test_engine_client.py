"""The api's engine client over real ZMQ sockets, without the other processes; and errors delivered to clients
through the real app and detokenizer, the test playing the scheduler."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import shutil
import threading
import time
from contextlib import aclosing
from typing import Iterator

import httpx
import openai
import pytest
import uvicorn
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from minisgl.core import Req, SamplingParams, TokenLogprob
from minisgl.distributed import free_port
from minisgl.messages import AbortReq, AddReq, LogprobEntry, Ready, ReqOutput, StatsReply, TextOutput
from minisgl.server.api import build_app
from minisgl.server.args import parse_args
from minisgl.server.detokenizer_worker import run_detokenizer
from minisgl.server.engine_client import EngineClient, RequestFailed
from minisgl.server.ipc import IpcPaths, inbox, outbox
from minisgl.server.metrics import Metrics
from minisgl.server.state import ServerState
from minisgl.tokenizer import TokenizerSource


@pytest.fixture
def ipc() -> Iterator[IpcPaths]:
    """The sockets' temp directory, removed after the test (IpcPaths.new leaves that to its caller)."""
    paths = IpcPaths.new()
    yield paths
    shutil.rmtree(paths.root, ignore_errors=True)


def test_ready_only_once_scheduler_and_detokenizer_report(ipc):
    async def scenario() -> None:
        client = EngineClient(ipc, Metrics("m"))
        router = asyncio.create_task(client.run())
        push = outbox(zmq.Context.instance(), ipc.api)
        push.send_pyobj(Ready("scheduler", {"max_seq_len": 64}))
        await asyncio.sleep(0.2)
        assert not client.ready.is_set()  # the detokenizer may still be loading: not ready yet
        push.send_pyobj(Ready("detokenizer"))
        await asyncio.wait_for(client.ready.wait(), 5)
        assert client.info["max_seq_len"] == 64
        router.cancel()

    asyncio.run(scenario())


def test_stats_reply_reaches_its_waiter(ipc):
    async def scenario() -> None:
        client = EngineClient(ipc, Metrics("m"))
        router = asyncio.create_task(client.run())
        scheduler = zmq.asyncio.Context.instance().socket(zmq.PULL)
        scheduler.bind(ipc.scheduler)
        push = outbox(zmq.Context.instance(), ipc.api)

        async def answer() -> None:
            ask = await scheduler.recv_pyobj()
            push.send_pyobj(StatsReply(ask.ask_id + 1000, {"wrong": True}))  # someone else's reply is ignored
            push.send_pyobj(StatsReply(ask.ask_id, {"free_pages": 7}))

        responder = asyncio.create_task(answer())
        assert await client.stats(timeout=5) == {"free_pages": 7}
        await responder
        router.cancel()

    asyncio.run(scenario())


def test_a_message_that_cannot_be_read_is_skipped_and_routing_goes_on(ipc):
    """The inbox is read until empty each time it wakes the loop (its descriptor wakes it only for what comes
    after that): bytes that are no message are logged and skipped, and what came after them is still routed."""
    async def scenario() -> None:
        client = EngineClient(ipc, Metrics("m"))
        router = asyncio.create_task(client.run())
        push = outbox(zmq.Context.instance(), ipc.api)
        push.send(b"not a pickle")
        push.send_pyobj(Ready("scheduler", {"max_seq_len": 64}))
        push.send_pyobj(Ready("detokenizer"))
        await asyncio.wait_for(client.ready.wait(), 5)
        router.cancel()

    asyncio.run(scenario())


def test_a_burst_of_arrivals_lets_the_running_streams_chunks_go_first(ipc):
    """Arrivals queued on the loop behind one another look at the inbox before their work: a running stream's
    chunk waiting there goes out before any of them, not after the whole burst."""
    async def scenario() -> None:
        client = EngineClient(ipc, Metrics("m"))  # no router task: only the arrivals read the inbox
        client.admit(1, None)
        seq = client.submit([1, 2, 3], SamplingParams(max_tokens=9), [], 0)
        order: list[str] = []

        async def stream() -> None:
            async for out in client.stream(seq):
                order.append(f"chunk {out.text}")
                if out.finish_reason:
                    return

        async def arrival(i: int) -> None:
            await client.streams_first()
            order.append(f"arrival {i}")

        consumer = asyncio.create_task(stream())
        await asyncio.sleep(0)  # the stream waits for its first output
        push = outbox(zmq.Context.instance(), ipc.api)  # kept: a socket collected at once drops what it sent
        push.send_pyobj([TextOutput(seq.rid, "a", [10], [], "length", 3, 0)])
        assert client.inbox.poll(5000)  # the output waits in the inbox, unread
        await asyncio.wait_for(asyncio.gather(*(arrival(i) for i in range(3)), consumer), 30)
        assert order == ["chunk a", "arrival 0", "arrival 1", "arrival 2"]
        assert not client.streams_due and client.open_sequences == 0

    asyncio.run(scenario())


def test_failing_all_at_shutdown_puts_the_error_before_any_unread_output(ipc):
    """Past --shutdown-timeout every sequence fails: its client's next read is the error, not the backlog of
    outputs it had not read yet (a stream sending that first could be cut by the server's exit, error-less)."""
    async def scenario() -> None:
        client = EngineClient(ipc, Metrics("m"))
        client.admit(1, None)
        seq = client.submit([1, 2, 3], SamplingParams(max_tokens=100), [], 0)
        for _ in range(50):  # the backlog: outputs routed to the sequence that its client has not read
            seq.deliver(TextOutput(seq.rid, "x", [7], [], None, 3, 0))
        client.fail_all("the server is shutting down", 503)
        with pytest.raises(RequestFailed) as failed:
            async for _ in client.stream(seq):
                raise AssertionError("an unread output came before the error")
        assert (failed.value.status, failed.value.message) == (503, "the server is shutting down")
        assert client.open_sequences == 0

    asyncio.run(scenario())


def test_outputs_a_consumer_has_not_read_come_as_one_in_order():
    """A consumer that falls behind reads everything its sequence received since its last read as one output:
    every token once, in order, with its logprob; the first output's prompt logprobs and scheduling time, the
    last one's finish and hidden state."""
    async def scenario() -> None:
        client = EngineClient(IpcPaths.new(), Metrics("m"))
        client.admit(1, None)
        seq = client.submit([1, 2, 3], SamplingParams(max_tokens=3), [], 0)
        scored = [LogprobEntry("p", 2, -0.1, [])]
        steps = [TextOutput(seq.rid, "a", [10], [LogprobEntry("a", 10, -1.0, [])], None, 3, 0,
                            prompt_logprobs=scored, scheduled_at=5.0, hidden_state=[0.1]),
                 TextOutput(seq.rid, "b", [11], [LogprobEntry("b", 11, -2.0, [])], None, 3, 1, hidden_state=[0.2]),
                 TextOutput(seq.rid, "c", [12], [LogprobEntry("c", 12, -3.0, [])], "stop", 3, 1, matched_stop=12)]
        for out in steps:  # three engine steps route before the consumer gets to run
            client._route([out])
        read = [out async for out in client.stream(seq)]
        assert len(read) == 1
        out = read[0]
        assert (out.text, out.new_ids, [e.logprob for e in out.logprobs]) == ("abc", [10, 11, 12], [-1.0, -2.0, -3.0])
        assert (out.finish_reason, out.matched_stop, out.cached_tokens, out.hidden_state) == ("stop", 12, 1, [0.2])
        assert (out.prompt_logprobs, out.scheduled_at) == (scored, 5.0)
        assert client.open_sequences == 0 and seq.completion_tokens == 3

    asyncio.run(scenario())


def test_inter_token_latencies_are_recorded_as_outputs_come_not_at_the_end():
    """Each output after the first adds one inter-token latency to /metrics when it is routed: a long stream's
    hundreds are not all recorded at its finish, where they held the event loop."""
    def itl_count(client: EngineClient) -> float:
        families = text_string_to_metric_families(client.metrics.render()[0].decode())
        return next(s.value for f in families for s in f.samples
                    if s.name.endswith("inter_token_latency_seconds_count"))

    async def scenario() -> None:
        client = EngineClient(IpcPaths.new(), Metrics("m"))
        client.admit(1, None)
        seq = client.submit([1, 2, 3], SamplingParams(max_tokens=9), [], 0)
        for i in range(3):
            client._route([TextOutput(seq.rid, "x", [10 + i], [], None, 3, 0)])
        assert client.open_sequences == 1 and itl_count(client) == 2  # the first output is the TTFT
        client._route([TextOutput(seq.rid, "", [], [], "abort", 3, 0)])
        assert client.open_sequences == 0 and itl_count(client) == 2

    asyncio.run(scenario())


def test_tokens_before_a_failure_are_read_then_the_error():
    """Outputs merged for a lagging consumer stop at a failed one: the tokens before it are still given, then
    the failure is raised."""
    async def scenario() -> None:
        client = EngineClient(IpcPaths.new(), Metrics("m"))
        client.admit(1, None)
        seq = client.submit([1, 2, 3], SamplingParams(max_tokens=9), [], 0)
        client._route([TextOutput(seq.rid, "a", [10], [], None, 3, 0)])
        client._route([TextOutput(seq.rid, "b", [11], [], None, 3, 0)])
        client._route([TextOutput(seq.rid, "", [], [], "abort", 3, 0, "engine fault")])
        read = []
        with pytest.raises(RequestFailed, match="engine fault"):
            async for out in client.stream(seq):
                read.append(out.new_ids)
        assert read == [[10, 11]]

    asyncio.run(scenario())


def test_one_consumer_reads_all_its_sequences():
    """n > 1: the sequences of one request are read by one consumer, each sequence's outputs in order and merged;
    leaving before they finish aborts the unfinished ones in the scheduler."""
    async def scenario() -> None:
        ipc = IpcPaths.new()
        client = EngineClient(ipc, Metrics("m"))
        scheduler = zmq.asyncio.Context.instance().socket(zmq.PULL)
        scheduler.bind(ipc.scheduler)
        client.admit(2, None)
        first, second = (client.submit([1, 2], SamplingParams(max_tokens=9), [], 0) for _ in range(2))
        for (a, b), finish in (((1, 5), None), ((2, 6), "length")):  # two steps; the first sequence ends
            client._route([TextOutput(first.rid, "", [a], [], finish, 2, 0),
                           TextOutput(second.rid, "", [b], [], None, 2, 0)])
        read = []
        async with aclosing(client.streams([first, second])) as streamed:
            async for seq, out in streamed:
                read.append((seq.rid, out.new_ids, out.finish_reason))
                if len(read) == 2:
                    break
        assert read == [(first.rid, [1, 2], "length"), (second.rid, [5, 6], None)]
        messages = [await asyncio.wait_for(scheduler.recv_pyobj(), 5) for _ in range(3)]
        assert [type(m).__name__ for m in messages] == ["AddReq", "AddReq", "AbortReq"]
        assert messages[2].rid == second.rid  # only the unfinished one

    asyncio.run(scenario())


# ---------------------------------------------------------------- errors reach their client


class StandInScheduler:
    """The real api (FastAPI app under uvicorn, in a thread) and the real detokenizer process, on their real
    sockets; the test plays scheduler rank 0: it takes the api's AddReq messages and sends ReqOutputs to the
    detokenizer."""

    def __init__(self, model: str):
        self.ipc = IpcPaths.new()
        self.tokenizer = TokenizerSource(model).load()
        self.inbox = inbox(zmq.Context.instance(), self.ipc.scheduler)
        self.to_detok = outbox(zmq.Context.instance(), self.ipc.detokenizer)
        self.detokenizer = multiprocessing.get_context("spawn").Process(
            target=run_detokenizer, args=(TokenizerSource(model), self.ipc, "warning"), daemon=True)
        self.detokenizer.start()
        args = parse_args(["--model", model, "--served-model-name", "tiny", "--device", "cpu"])
        self.state = ServerState(args, self.ipc, self.tokenizer)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.state), port=self.port, log_level="warning"))
        self.server_thread = threading.Thread(target=self.server.run, daemon=True)
        self.server_thread.start()
        self.to_api = outbox(zmq.Context.instance(), self.ipc.api)  # kept: a closed socket drops what it holds
        self.to_api.send_pyobj(Ready("scheduler", {
            "max_seq_len": 64, "vocab_size": 512, "kv_capacity_tokens": 4096, "dtype": "float32", "device": "cpu",
            "tp_size": 1}))
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError("the api never became ready")

    def next_request(self) -> Req:
        while True:
            assert self.inbox.poll(30_000), "no request reached the scheduler"
            message = self.inbox.recv_pyobj()
            if isinstance(message, AddReq):
                return message.req

    def emit(self, req: Req, ids: list[int], finish: str | None = None, error: str | None = None) -> None:
        self.to_detok.send_pyobj([ReqOutput(req.rid, ids, [], finish, len(req.prompt_ids), 0, error)])

    def stop(self) -> None:
        self.server.should_exit = True
        self.server_thread.join(timeout=30)
        self.detokenizer.kill()
        self.detokenizer.join(timeout=30)
        shutil.rmtree(self.ipc.root, ignore_errors=True)


@pytest.fixture(scope="module")
def stand_in(tiny_models):
    engine = StandInScheduler(tiny_models["qwen3"])
    yield engine
    engine.stop()


def test_a_failed_request_answers_500_and_the_others_finish(stand_in):
    client = openai.OpenAI(base_url=f"{stand_in.url}/v1", api_key="x", max_retries=0)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        calls = [pool.submit(client.completions.create, model="tiny", prompt=f"request {i}", max_tokens=3)
                 for i in range(3)]
        reqs = sorted((stand_in.next_request() for _ in range(3)), key=lambda r: r.rid)
        for req in reqs:
            stand_in.emit(req, [40])
        stand_in.emit(reqs[1], [], "abort", error="sampler fault: NaN in the logits")  # fails alone
        for req in (reqs[0], reqs[2]):
            stand_in.emit(req, [41, 42], "length")
        outcomes = []
        for call in calls:
            try:
                outcomes.append(call.result(timeout=30).choices[0].finish_reason)
            except openai.InternalServerError as exc:
                outcomes.append(exc.body)
    failed = [o for o in outcomes if isinstance(o, dict)]
    assert sorted(o for o in outcomes if isinstance(o, str)) == ["length", "length"]
    assert failed == [{"message": "sampler fault: NaN in the logits", "type": "server_error",
                       "param": None, "code": None}]
    assert stand_in.state.client.open_sequences == 0 and stand_in.state.client.queued == 0


def test_a_failed_stream_ends_with_an_error_event_then_done(stand_in):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{stand_in.url}/v1/chat/completions", json=body, timeout=30) as resp:
        req = stand_in.next_request()
        stand_in.emit(req, stand_in.tokenizer("Hello", add_special_tokens=False)["input_ids"])
        stand_in.emit(req, [], "abort", error="engine fault in this request")
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert resp.status_code == 200
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "Hello"
    assert json.loads(events[-2]) == {"error": {"message": "engine fault in this request",
                                                "type": "server_error", "param": None, "code": None}}
    assert events[-1] == "[DONE]"
    # the server goes on serving
    call = concurrent.futures.ThreadPoolExecutor(1).submit(
        httpx.post, f"{stand_in.url}/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1},
        timeout=30)
    stand_in.emit(stand_in.next_request(), [7], "length")
    assert call.result().json()["choices"][0]["finish_reason"] == "length"


def test_a_bug_mid_stream_ends_a_responses_stream_with_response_failed(stand_in):
    """Not only a failed sequence: any exception while a /v1/responses stream runs (here the api is sent an
    output its code cannot add up) ends it with `response.failed`, carrying the 500 error type every other
    error body has; the response is stored as failed."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{stand_in.url}/v1/responses", json=body, timeout=30) as resp:
        req = stand_in.next_request()
        stand_in.emit(req, stand_in.tokenizer("Hello", add_special_tokens=False)["input_ids"])
        events = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                if events[-1]["type"] == "response.output_text.delta":  # "Hello" is out: now the bad output
                    stand_in.to_api.send_pyobj([TextOutput(req.rid, None, [], [], None, len(req.prompt_ids), 0)])
    assert resp.status_code == 200
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hello"]
    failed = events[-1]
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "internal error: TypeError"}
    stored = httpx.get(f"{stand_in.url}/v1/responses/{failed['response']['id']}", timeout=30).json()
    assert stored["status"] == "failed"
    assert stand_in.inbox.poll(30_000)
    abort = stand_in.inbox.recv_pyobj()  # the sequence is aborted (its KV pages freed) ...
    assert isinstance(abort, AbortReq) and abort.rid == req.rid
    stand_in.emit(req, [], "abort")  # ... as the scheduler confirms
    deadline = time.monotonic() + 30
    while stand_in.state.client.open_sequences and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stand_in.state.client.open_sequences == 0


def sentence_ids(stand_in, n: int) -> list[int]:
    """`n` ids of plain words: each token's text is a piece of the answer's text."""
    return stand_in.tokenizer("the quick brown fox jumps over the lazy dog " * 8, add_special_tokens=False)[
        "input_ids"][:n]


def stream_behind(stand_in, path: str, body: dict, ids: list[int]) -> list[dict]:
    """Every step of `ids` (one token each, logprob -i/10, the last one finishing) reaches the api before its client
    reads a byte; the chunks the client then gets."""
    with httpx.stream("POST", f"{stand_in.url}{path}", json=body, timeout=30) as resp:
        req = stand_in.next_request()
        for i, token in enumerate(ids):
            out = ReqOutput(req.rid, [token], [TokenLogprob(token, -i / 10, [(token, -i / 10)])],
                            "length" if i == len(ids) - 1 else None, len(req.prompt_ids), 0)
            stand_in.to_detok.send_pyobj([out])
        return [json.loads(line[len("data: "):]) for line in resp.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_stream_behind_the_engine_gets_every_token_once_in_order_with_its_logprobs(stand_in):
    """However the steps are grouped into chunks, the client gets each token once, in order, with exactly one
    logprob entry each and offsets into its text."""
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 40, "stream": True, "logprobs": 1,
            "return_token_ids": True}
    ids = sentence_ids(stand_in, 40)
    choices = [c["choices"][0] for c in stream_behind(stand_in, "/v1/completions", body, ids)]
    assert [t for c in choices for t in c["token_ids"] or []] == ids
    logprobs = [c["logprobs"] for c in choices if c["logprobs"]]
    assert [lp for c in logprobs for lp in c["token_logprobs"]] == pytest.approx([-i / 10 for i in range(40)])
    text = "".join(c["text"] for c in choices)
    offsets = [o for c in logprobs for o in c["text_offset"]]
    tokens = [t for c in logprobs for t in c["tokens"]]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(40)] and text == "".join(tokens)
    assert choices[-1]["finish_reason"] == "length"


def test_a_chat_stream_behind_the_engine_gets_every_token_once_with_its_logprob_and_usage(stand_in):
    """The chat stream, lagging the same way: content and logprobs of every token once, in order; each chunk's
    continuous usage counts the tokens sent so far, the usage chunk all of them."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": True,
            "logprobs": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    ids = sentence_ids(stand_in, 30)
    chunks = stream_behind(stand_in, "/v1/chat/completions", body, ids)
    *chunks, usage = chunks
    choices = [c["choices"][0] for c in chunks]
    assert [t for c in choices for t in c.get("token_ids") or []] == ids
    entries = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
    assert [e["logprob"] for e in entries] == pytest.approx([-i / 10 for i in range(30)])
    assert "".join(c["delta"].get("content") or "" for c in choices) == "".join(e["token"] for e in entries)
    sent = 0
    for c, choice in zip(chunks, choices):
        sent += len(choice.get("token_ids") or [])
        assert c["usage"]["completion_tokens"] == sent
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 30
    assert choices[-1]["finish_reason"] == "length"
