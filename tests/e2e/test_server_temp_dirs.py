"""No file or directory of the server's stays in the temp dir, whichever way it exits: SIGTERM (drained, or
while it starts), a child process killed, a failed start. Every test runs a real `python -m minisgl` with TMPDIR
a fresh directory and expects that directory empty once the process has exited; a running --demo server has
two there (its model and its ipc sockets), a long-running node used to collect them."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from server_fixtures import wait_healthy

from minisgl.distributed import free_port
from minisgl.tools.tiny_model import make_tiny_model


class Launched:
    """A server process with TMPDIR a fresh, short directory (ipc socket paths must stay under ~100 bytes), and
    torch's compile cache elsewhere: importing torch._dynamo (transformers does, writing --demo's model) makes
    $TMPDIR/torchinductor_$USER, a cache that every torch process of the user shares, not the server's."""

    def __init__(self, tmp_path: Path, *args: str, port: int | None = None):
        self.temp = Path(tempfile.mkdtemp(prefix="msgl-"))
        port = port or free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "TMPDIR": str(self.temp), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
        self.log = tmp_path / "server.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "minisgl", *args, "--port", str(port)], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout: float = 120) -> None:
        wait_healthy(self.url, self.proc, self.output, timeout)
        made = os.listdir(self.temp)  # the test is not vacuous: the server's directories are there now
        assert any(n.startswith("minisgl-demo-") for n in made), made
        assert any(n.startswith("minisgl-") and not n.startswith("minisgl-demo-") for n in made), made

    def exit_code(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text()

    def left_behind(self) -> list[str]:
        return sorted(os.listdir(self.temp))


@pytest.fixture
def launch(tmp_path):
    started: list[Launched] = []

    def start(*args: str, port: int | None = None) -> Launched:
        started.append(Launched(tmp_path, *args, port=port))
        return started[-1]

    yield start
    for server in started:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
        shutil.rmtree(server.temp, ignore_errors=True)


def test_sigterm_leaves_nothing(launch):
    server = launch("--demo")
    server.wait_healthy()
    server.proc.send_signal(signal.SIGTERM)
    assert server.exit_code() == 0, server.output()
    assert server.left_behind() == []


def test_sigterm_while_starting_leaves_nothing(launch):
    """The signal lands while --demo writes its model (a second or so), before uvicorn handles signals: the process
    still exits through its clean-up, not at once by the signal's default action."""
    server = launch("--demo")
    deadline = time.monotonic() + 60
    while not any(n.startswith("minisgl-demo-") for n in server.left_behind()):
        assert time.monotonic() < deadline and server.proc.poll() is None
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGTERM)
    assert server.exit_code() == 128 + signal.SIGTERM, server.output()  # as a shell reports death by SIGTERM
    assert server.left_behind() == []


@pytest.mark.parametrize("child", ["scheduler-0", "detokenizer"])
def test_a_killed_child_leaves_nothing(launch, child):
    server = launch("--demo")
    server.wait_healthy()
    os.kill(httpx.get(f"{server.url}/get_server_info").json()["children"][child], signal.SIGKILL)
    assert server.exit_code() == 1, server.output()
    assert server.left_behind() == []


def test_a_port_in_use_leaves_nothing(launch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = launch("--demo", port=taken.getsockname()[1])
        assert server.exit_code(timeout=120) == 3, server.output()  # uvicorn's start-up failure
    assert "address already in use" in server.output()
    assert server.left_behind() == []


def test_a_context_longer_than_the_model_leaves_nothing(launch):
    """Refused after --demo has written its model."""
    server = launch("--demo", "--context-length", "100000")
    assert server.exit_code() == 2, server.output()
    assert server.left_behind() == []


def test_unloadable_weights_leave_nothing(launch, tmp_path):
    """A model directory whose weights file is not a checkpoint: the scheduler dies while loading, after the ipc
    directory was made."""
    model = make_tiny_model(tmp_path / "broken", arch="qwen3")
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    server = launch("--model", str(model), "--device", "cpu")
    assert server.exit_code(timeout=120) == 1, server.output()
    assert "scheduler-0" in server.output()
    assert server.left_behind() == []
