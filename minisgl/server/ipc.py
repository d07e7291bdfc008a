"""ZMQ plumbing between the server's processes: where their sockets live, and how a child process behaves.

Each process binds one PULL socket (its inbox) and PUSHes to the others' inboxes. What travels on them, and
which way, is `minisgl/messages.py`.
"""

from __future__ import annotations

import ctypes
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


def outbox(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
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
