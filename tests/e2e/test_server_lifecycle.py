"""Server processes over their lifetime: draining on SIGTERM, dying children, TP = 2, the shell."""

from __future__ import annotations

import concurrent.futures
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from importlib.util import find_spec

import httpx
import pytest
from helpers import DEVICE, random_prompts
from server_fixtures import Server, long_context_copy

from minisgl.tools.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models["qwen3"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(") ")[1][0] != "Z"


def test_sigterm_drains_in_flight_requests_then_exits_0(model, tmp_path):
    # 10,000 tokens (a context and a pool for them): ~20 s of decoding on this 2-core CPU, so the request is still
    # running when the checks below reach the draining server. 3,000 (~3 s) once finished first in CI: the
    # scheduler decodes on while a loaded machine delays the api process.
    srv = Server(long_context_copy(model, tmp_path, 16384), "--shutdown-timeout", "300", "--num-pages", "16384")
    body = {"model": "tiny", "prompt": "Keep talking", "max_tokens": 10000, "ignore_eos": True, "stream": True}
    result: dict = {}
    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as resp:
            result["status"] = resp.status_code
            result["events"] = []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    result["events"].append(line)
                    streaming.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(timeout=30)  # the request is running: its first tokens came
    os.killpg(srv.proc.pid, signal.SIGTERM)  # the whole group, as a Ctrl-C or `timeout` does: children ignore it
    deadline = time.monotonic() + 30  # seconds at most on a loaded machine
    while httpx.get(f"{srv.url}/health").status_code != 503:  # the signal is handled on the event loop
        assert time.monotonic() < deadline
        time.sleep(0.02)
    refused = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "new", "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["retry-after"]
    thread.join(timeout=300)  # a minute and more on a loaded 2-core machine
    assert result["status"] == 200 and result["events"][-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in result["events"][-2]
    assert srv.proc.wait(timeout=30) == 0
    assert "draining 1 in-flight request" in srv.output()
    # start-up is logged: the engine's parts, then the time to ready since the process started
    assert "engine built in" in srv.output() and "warm-up" in srv.output()
    ready = re.search(r"ready in (\d+\.\d) s.*\(HTTP by (\w+), (\w+) loop\)", srv.output())
    assert ready and 0 < float(ready[1]) < 120
    # the parser and loop uvicorn serves with: httptools and uvloop wherever installed (the project depends on both)
    expected = ("httptools" if find_spec("httptools") else "h11", "uvloop" if find_spec("uvloop") else "asyncio")
    assert ready.groups()[1:] == expected


def test_a_dead_scheduler_takes_the_server_down(model):
    srv = Server(model)
    children = srv.info()["children"]
    os.kill(children["scheduler-0"], signal.SIGKILL)
    start = time.monotonic()
    code = srv.proc.wait(timeout=10)
    assert code != 0 and time.monotonic() - start < 10
    assert "scheduler-0" in srv.output() and "exited with code -9" in srv.output()
    deadline = time.monotonic() + 10  # the kernel kills them (PR_SET_PDEATHSIG); a loaded machine takes a while
    while any(alive(pid) for pid in children.values()):
        assert time.monotonic() < deadline, "orphaned child processes"
        time.sleep(0.05)


def test_tp2_server_answers_like_tp1(model):
    prompts = random_prompts([3, 17, 40, 90], 400, seed=30)
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    answers = []
    for extra in ([], ["--tp", "2"]):
        srv = Server(model, *extra)
        try:
            resp = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()
            answers.append([c["text"] for c in resp["choices"]])
            if extra:
                assert srv.info()["tp_size"] == 2
        finally:
            assert srv.stop() == 0
    assert answers[0] == answers[1] and all(answers[0])


def read_until(fd: int, marker: bytes, timeout: float = 120) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout
    while marker not in data:
        assert time.monotonic() < deadline, f"no {marker!r} in {data!r}"
        if select.select([fd], [], [], 0.5)[0]:
            try:
                data += os.read(fd, 4096)
            except OSError:
                break
    return data


def test_shell_chats_and_resets_through_a_terminal(model):
    leader, follower = pty.openpty()
    cmd = [sys.executable, "-m", "minisgl", "--model", model, "--device", DEVICE, "--num-pages", "2048", "--shell"]
    proc = subprocess.Popen(cmd, stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    try:
        assert b"/reset clears the history" in read_until(leader, b"> ")
        os.write(leader, b"Hello there\n")
        reply = read_until(leader, b"\n> ")
        assert reply.split(b"Hello there", 1)[1].strip(b"\r\n> ")  # some generated text came back
        os.write(leader, b"/reset\n")
        assert b"history cleared" in read_until(leader, b"\n> ")
        os.write(leader, b"/exit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)


def test_health_is_503_while_loading_and_demo_serves_a_chat():
    srv = Server("--demo")
    try:
        assert 503 in srv.health_seen and srv.health_seen[-1] == 200  # loading, then ready
        body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
        resp = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
    finally:
        assert srv.stop() == 0


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> str:
    """The tiny qwen3 with a context long enough that its one running request outlasts the test."""
    return str(make_tiny_model(tmp_path_factory.mktemp("long") / "qwen3", arch="qwen3",
                               max_position_embeddings=65536))


def test_full_waiting_queue_gets_503_with_retry_after(long_context_model):
    # a pool for the long request's whole context: in the default 4,096 pages it ended ('length') after ~4,000
    # tokens, and on a loaded machine before the two short requests were counted as waiting
    srv = Server(long_context_model, "--max-queued-requests", "2", "--max-running-requests", "1",
                 "--num-pages", "65536")
    short = {"model": "tiny", "prompt": "wait for it", "max_tokens": 3, "ignore_eos": True}

    def wait_for(key: str, value: int) -> None:
        deadline = time.monotonic() + 30
        while srv.info()["scheduler"][key] != value:
            assert time.monotonic() < deadline, (key, value, srv.info()["scheduler"])
            time.sleep(0.05)

    try:
        long = {**short, "max_tokens": srv.info()["max_seq_len"] - 8, "stream": True}  # the most the context allows
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=long, timeout=60) as running:
            lines = running.iter_lines()  # keep it: a discarded iterator closes the stream
            next(lines)
            wait_for("num_running", 1)  # the one running slot is taken
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                waiting = [pool.submit(httpx.post, f"{srv.url}/v1/completions", json=short, timeout=60)
                           for _ in range(2)]
                wait_for("num_waiting", 2)  # two requests wait for their first token: the queue is full
                refused = httpx.post(f"{srv.url}/v1/completions", json=short, timeout=5)
                assert refused.status_code == 503 and refused.headers["retry-after"]
                assert refused.json()["error"]["type"] == "service_unavailable"
                running.close()  # the long request is aborted; the waiting ones run
                assert [w.result().status_code for w in waiting] == [200, 200]
        assert httpx.post(f"{srv.url}/v1/completions", json=short, timeout=30).status_code == 200
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("model", ["/no/such/model", "."])  # missing; a directory without config.json
def test_a_wrong_model_is_one_line_and_exit_2(model, tmp_path):
    """Told as argparse tells a wrong flag: the reason on one line of stderr, no traceback, exit status 2."""
    run = subprocess.run([sys.executable, "-m", "minisgl", "--model", model, "--device", "cpu"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    [line] = run.stderr.strip().splitlines()
    assert line.startswith("minisgl: error: ModelLoadError: ")  # the name the operator's status quotes
    assert ("no config.json" if model == "." else "not a local directory") in line
