"""ZMQ plumbing between the server's processes: where their sockets live, and how a child process behaves.

Each process binds one PULL socket (its inbox) and PUSHes to the others' inboxes. What travels on them, and
which way, is `minisgl/messages.py`.
"""

from __future__ import annotations

import ctypes
import gc
import signal
import tempfile
from dataclasses import dataclass

import zmq


@dataclass
class IpcPaths:
    scheduler: str
    detokenizer: str
    api: str
    root: str  # the temp directory that holds the three: whoever calls `new` removes it

    @classmethod
    def new(cls) -> "IpcPaths":
        root = tempfile.mkdtemp(prefix="minisgl-")  # short: ipc paths are limited to ~100 bytes
        return cls(f"ipc://{root}/scheduler", f"ipc://{root}/detokenizer", f"ipc://{root}/api", root)


def inbox(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.bind(addr)
    return sock


def outbox(ctx: zmq.Context, addr: str, unbounded: bool = False) -> zmq.Socket:
    """`unbounded`: no send high-water mark, a send never blocks (what may queue must be bounded elsewhere)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if unbounded:
        sock.setsockopt(zmq.SNDHWM, 0)  # before connect: the pipe takes the mark it is created with
    sock.connect(addr)
    return sock


def become_child() -> None:
    """Children leave shutdown to the server process: they ignore SIGINT/SIGTERM (a Ctrl-C or a signal
    to the whole process group must not kill them while the server drains), and on Linux the kernel
    SIGKILLs them when the server process dies, so nothing is orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def freeze_startup_heap() -> None:
    """Call once a server process is built, before it serves: what start-up made (modules, the model, the app)
    lives as long as the process, so the cyclic collector stops scanning it. Unfrozen, each full collection of a
    server process walked those few hundred thousand objects while serving: a pause of 100-700 ms (this 2-core
    machine) every few seconds, on every stream at once."""
    gc.collect()
    gc.freeze()
