"""Real `python -m minisgl` server processes for tests: `Server` starts and stops one; `serving` is a
fixture's server, which must stop cleanly (exit status 0) at the fixture's end."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx
import openai
from helpers import DEVICE
from prometheus_client.parser import text_string_to_metric_families

from minisgl.distributed import free_port


class Server:
    def __init__(self, model: str, *extra: str, name: str = "tiny", api_key: str | None = None):
        self.port = free_port()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        extra = (*extra, "--api-key", api_key) if api_key else extra
        self.url = f"http://127.0.0.1:{self.port}"
        # The server's output, read back on failure; an unnamed file: nothing of it is left in the temp dir.
        self.log = tempfile.TemporaryFile("w+")
        source = ["--model", model, "--served-model-name", name] if model != "--demo" else ["--demo"]
        cmd = [sys.executable, "-m", "minisgl", *source, "--port", str(self.port), "--device", DEVICE,
               "--dtype", "float32", "--num-pages", "4096", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.health_seen: list[int] = []  # /health status codes observed while starting
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 120) -> None:
        wait_healthy(self.url, self.proc, self.output, timeout, self.health_seen)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def openai_client(self, api_key: str = "unused") -> openai.OpenAI:
        """The real openai client against this server, without its retries (a test sees the first answer)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def info(self) -> dict:
        return httpx.get(f"{self.url}/get_server_info", headers=self.headers, timeout=10).json()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return self.proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, output: Callable[[], str], timeout: float = 120,
                 seen: list[int] | None = None) -> None:
    """Poll `url`/health until it answers 200; fail at once, with the server's output, if `proc` exits first.
    `seen` collects the status codes answered meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited early:\n{output()}"
        try:
            status = httpx.get(f"{url}/health", timeout=1).status_code
        except httpx.HTTPError:
            status = None
        if status is not None and seen is not None:
            seen.append(status)
        if status == 200:
            return
        time.sleep(0.2)
    raise TimeoutError(f"server not healthy after {timeout}s:\n{output()}")


def long_context_copy(model: str, directory: Path, positions: int) -> str:
    """The tiny model with a longer context (rotary positions are computed, so only config.json changes)."""
    copy = directory / "long-context"
    shutil.copytree(model, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return str(copy)


def metric_samples(server: Server) -> dict[str, float]:
    """Every sample of the server's /metrics now, by name (labels aside)."""
    return {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
            for s in f.samples}


def pages_all_free(info: dict) -> bool:
    s = info["scheduler"]
    return s["num_running"] == s["num_waiting"] == 0 and s["free_pages"] + s["evictable_pages"] == s["total_pages"]


@contextmanager
def serving(model: str, *extra: str, **options) -> Iterator[Server]:
    """A server for a fixture's scope (`yield from`-style: `with serving(...) as srv: yield srv`)."""
    srv = Server(model, *extra, **options)
    try:
        yield srv
    finally:
        assert srv.stop() == 0
