"""Start the whole stack: scheduler ranks and the detokenizer as child processes, the api in this one.

A child that dies takes the server down (non-zero exit); SIGTERM drains: /health turns 503, new
requests get 503, in-flight ones finish (up to --shutdown-timeout, after which they get an error), then
the process exits 0. Every exit, a failed start included, stops the children and removes the server's
temp directories (the ipc sockets', --demo's model).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import uvicorn

from minisgl.children import end_all, wait_for_exit
from minisgl.distributed import free_port
from minisgl.models import resolve_model_path
from minisgl.models.config import ModelConfig
from minisgl.server.api import build_app
from minisgl.server.args import ServerArgs
from minisgl.server.detokenizer_worker import run_detokenizer
from minisgl.server.ipc import IpcPaths, freeze_startup_heap
from minisgl.server.scheduler_loop import run_scheduler
from minisgl.server.state import ServerState

logger = logging.getLogger("minisgl")

DEMO_CONTEXT = 40960  # tokens: Qwen3's max_position_embeddings


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains: requests in flight get up to `timeout` seconds to
    finish, then those still running get an error (503, or an error event on a stream) and the server
    stops. A second signal stops it at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, timeout: float):
        super().__init__(config)
        self.state, self.timeout = state, timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.state.draining or self.loop is None:  # a second signal, or not serving yet: stop now
            return super().handle_exit(sig, frame)
        self.state.draining = True
        logger.info("signal %d: draining %d in-flight request(s), up to %.0fs", sig, self.state.client.open_sequences,
                    self.timeout)
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.drain_task = self.loop.create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.state.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.busy:
            logger.warning("shutdown timeout: failing %d request(s) still in flight", self.state.client.open_sequences)
            self.state.codec.close()
            self.state.client.fail_all("the server is shutting down", 503)
        self.should_exit = True


class Lifetime:
    """What the api process undoes at each of its exits: its children and its temp directories. `serve` ends it
    on a return or an exception; the paths that leave through os._exit (which skips `finally`) end it first."""

    def __init__(self) -> None:
        self.children: list[multiprocessing.Process] = []
        self.dirs: list[str] = []
        self.stopping = threading.Event()  # children's exits are expected from now on

    def temp_dir(self, prefix: str) -> str:
        path = tempfile.mkdtemp(prefix=prefix)
        self.dirs.append(path)
        return path

    def end(self) -> None:
        self.stopping.set()
        end_all(self.children)  # dead before their directory goes: none can bind a socket in it again
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)


def start_children(args: ServerArgs, ipc: IpcPaths) -> list[multiprocessing.Process]:
    spawn = multiprocessing.get_context("spawn")
    port, tp = free_port(), args.engine.tp_size
    children = [spawn.Process(target=run_scheduler, name=f"scheduler-{rank}", daemon=True,
                              args=(rank, tp, port, args.engine, ipc, args.log_level)) for rank in range(tp)]
    tokenizer = None if args.skip_tokenizer_init else args.engine.tokenizer_source(args.engine.model)
    children.append(spawn.Process(target=run_detokenizer, name="detokenizer", daemon=True,
                                  args=(tokenizer, ipc, args.log_level)))
    for child in children:
        child.start()
    return children


def watch_children(life: Lifetime) -> None:
    """Any child exiting on its own is fatal: say which, stop the rest, exit non-zero."""
    deaths = wait_for_exit(life.children, life.stopping)
    for death in deaths:
        logger.error("%s; shutting the server down", death)
    if deaths:
        life.end()
        os._exit(1)


def serve(args: ServerArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [api] %(levelname)s %(message)s")
    # A SIGTERM before uvicorn takes the signal over (or a second one, which uvicorn raises again once it has
    # stopped) exits through `finally` below, not at once with the temp directories left behind.
    signal.signal(signal.SIGTERM, lambda sig, frame: sys.exit(128 + sig))
    life = Lifetime()
    try:
        return _serve(args, life)
    finally:
        life.end()


def _serve(args: ServerArgs, life: Lifetime) -> int:
    if args.demo:
        from minisgl.tools.tiny_model import QWEN3_CHAT_TEMPLATE, make_tiny_model

        # Qwen3's own context and chat template (tools, thinking), so launch commands and requests written for
        # real models (--max-model-len 8192, tools, enable_thinking) fit it.
        args.engine.model = str(make_tiny_model(life.temp_dir("minisgl-demo-"), arch="qwen3",
                                                max_position_embeddings=DEMO_CONTEXT,
                                                chat_template=QWEN3_CHAT_TEMPLATE))
        logger.info("demo: serving a tiny random qwen3 model from %s on the CPU", args.engine.model)
    args.engine.model = str(resolve_model_path(args.engine.model))
    longest = ModelConfig.from_dir(args.engine.model).max_position_embeddings
    if args.engine.max_seq_len is not None and args.engine.max_seq_len > longest:
        logger.error("--context-length %d is longer than this model's maximum of %d tokens "
                     "(max_position_embeddings); leave it out or give at most %d", args.engine.max_seq_len, longest,
                     longest)
        return 2
    tokenizer = None
    if not args.skip_tokenizer_init:
        source = args.engine.tokenizer_source(args.engine.model)
        try:
            tokenizer = source.load()
        except Exception as exc:  # no such directory or Hub id, its code not trusted...: say which and why
            logger.error("the tokenizer %s could not be loaded: %s: %s", source.path, type(exc).__name__, exc)
            return 2
        if tokenizer is None:
            logger.error("no tokenizer in %s: the server needs one (tokenizer.json / tokenizer_config.json beside "
                         "config.json, or --tokenizer DIR), or --skip-tokenizer-init to serve token ids only",
                         source.path)
            return 2
    ipc = IpcPaths.new()
    life.dirs.append(ipc.root)
    life.children = start_children(args, ipc)
    threading.Thread(target=watch_children, args=(life,), daemon=True).start()
    state = ServerState(args, ipc, tokenizer)
    state.children = {child.name: child.pid for child in life.children}
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port, uds=args.uds, log_level="warning",
                            timeout_graceful_shutdown=5)
    freeze_startup_heap()
    DrainingServer(config, state, args.shutdown_timeout).run()
    life.end()
    logger.info("server stopped")
    logging.shutdown()
    # Exit now, not when a tokenizer thread still busy with a huge prompt is done: the shutdown bound holds.
    os._exit(0)
