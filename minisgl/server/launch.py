"""Start the whole stack: scheduler ranks and the detokenizer as child processes, the api in this one.

A child that dies takes the server down (non-zero exit); SIGTERM drains: /health turns 503, new
requests get 503, in-flight ones finish (up to --shutdown-timeout), then the process exits 0.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import threading
import time
from pathlib import Path

import uvicorn

from minisgl.distributed import free_port
from minisgl.llm import has_tokenizer
from minisgl.models import resolve_model_path
from minisgl.server.api import ServerState, build_app
from minisgl.server.args import ServerArgs
from minisgl.server.detokenizer_worker import run_detokenizer
from minisgl.server.ipc import IpcPaths
from minisgl.server.scheduler_loop import run_scheduler

logger = logging.getLogger("minisgl")


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains in-flight requests before exiting."""

    def __init__(self, config: uvicorn.Config, state: ServerState, timeout: float):
        super().__init__(config)
        self.state, self.timeout = state, timeout

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining:  # a second signal: stop now
            return super().handle_exit(sig, frame)
        self.state.draining = True
        logger.info("signal %d: draining %d in-flight request(s), up to %.0fs", sig, self.state.client.in_flight,
                    self.timeout)
        threading.Thread(target=self._exit_when_drained, daemon=True).start()

    def _exit_when_drained(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.state.client.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True


def start_children(args: ServerArgs, ipc: IpcPaths) -> list[multiprocessing.Process]:
    spawn = multiprocessing.get_context("spawn")
    port, tp = free_port(), args.engine.tp_size
    children = [spawn.Process(target=run_scheduler, name=f"scheduler-{rank}", daemon=True,
                              args=(rank, tp, port, args.engine, ipc, args.log_level)) for rank in range(tp)]
    children.append(spawn.Process(target=run_detokenizer, name="detokenizer", daemon=True,
                                  args=(args.engine.model, ipc, args.log_level)))
    for child in children:
        child.start()
    return children


def watch_children(children: list[multiprocessing.Process], stopping: threading.Event) -> None:
    """Any child exiting on its own is fatal: say which, stop the rest, exit non-zero."""
    ended = multiprocessing.connection.wait([c.sentinel for c in children])
    if stopping.is_set():
        return
    for child in children:
        if child.sentinel in ended:  # its pipe closes a moment before it can be reaped: join for the code
            child.join(timeout=1)
            logger.error("%s (pid %d) exited with code %s; shutting the server down", child.name, child.pid,
                         child.exitcode)
    for child in children:
        child.kill()
    os._exit(1)


def serve(args: ServerArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [api] %(levelname)s %(message)s")
    if args.demo:
        from minisgl.tools.tiny_model import make_tiny_model

        args.engine.model = str(make_tiny_model(tempfile.mkdtemp(prefix="minisgl-demo-"), arch="qwen3"))
        logger.info("demo: serving a tiny random qwen3 model from %s on the CPU", args.engine.model)
    args.engine.model = str(resolve_model_path(args.engine.model))
    if not has_tokenizer(Path(args.engine.model)):
        logger.error("no tokenizer in %s: the server needs one (tokenizer.json / tokenizer_config.json beside "
                     "config.json); the offline LLM API runs without one, on token ids", args.engine.model)
        return 2
    ipc = IpcPaths.new()
    children = start_children(args, ipc)
    stopping = threading.Event()
    threading.Thread(target=watch_children, args=(children, stopping), daemon=True).start()
    state = ServerState(args, ipc)
    state.children = {child.name: child.pid for child in children}
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=5)
    DrainingServer(config, state, args.shutdown_timeout).run()
    stopping.set()
    for child in children:
        child.kill()
        child.join(timeout=10)
    logger.info("server stopped")
    return 0
