"""ZMQ plumbing between the server's processes, and the messages that cross it.

    api ──AddReq/AbortReq/StatsRequest──▶ scheduler rank 0 ──ReqOutput──▶ detokenizer ──TextOutput──▶ api
    api ──DetokRegister──▶ detokenizer          detokenizer ──AbortReq (stop string hit)──▶ scheduler
    scheduler ──Ready/StatsReply──▶ api          detokenizer ──Ready──▶ api

Each process binds one PULL socket (its inbox) and PUSHes to the others' inboxes. Messages are small
pickled dataclasses; token ids travel as lists, never tensors.
"""

from __future__ import annotations

import ctypes
import gc
import signal
import tempfile
from dataclasses import dataclass, field
from typing import NamedTuple

import zmq

from minisgl.core import TokenLogprob


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


class Packed:
    """A dataclass pickled as the tuple of its fields' values (its __init__ sets each one, in order), not as a
    dict of them: a step's outputs, one per running request, pickle ~3x and unpickle ~6x faster, on the
    scheduler's and the api's busiest paths."""

    def __reduce__(self):
        return type(self), tuple(self.__dict__.values())


@dataclass
class ReqOutput(Packed):
    """Scheduler -> detokenizer: what one request produced since its last output."""

    rid: int
    new_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None  # the scheduler failed this request alone (finish_reason "abort")
    prompt_logprobs: list[TokenLogprob] | None = None  # with its first output, when asked for
    scheduled_at: float | None = None  # with its first output: when it was first scheduled (time.monotonic)
    hidden_state: list[float] | None = None  # the latest token's final hidden state (return_hidden_states)


@dataclass
class DetokRegister:
    """Api -> detokenizer, before the request reaches the scheduler: how to turn its ids into text."""

    rid: int
    stop: list[str]
    skip_special_tokens: bool = True


class Alternative(NamedTuple):
    text: str
    logprob: float
    token_id: int


class LogprobEntry(NamedTuple):
    """One token's log-probability as the detokenizer passes it on: its text and id, and the top
    alternatives (ids kept, so that two tokens of one text stay apart)."""

    text: str
    token_id: int
    logprob: float | None  # None: an echoed prompt's first token (nothing comes before it)
    top: list[Alternative]


@dataclass
class TextOutput(Packed):
    """Detokenizer -> api: the text a request produced since its last output."""

    rid: int
    text: str
    new_ids: list[int]
    logprobs: list[LogprobEntry]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None  # the request failed alone (finish_reason "abort"); its client gets this message
    matched_stop: str | int | None = None  # with finish_reason "stop": the stop string, or the stop/EOS token id
    prompt_logprobs: list[LogprobEntry] | None = None  # prompt tokens 1..
    scheduled_at: float | None = None  # as in ReqOutput
    hidden_state: list[float] | None = None  # as in ReqOutput


@dataclass
class StatsRequest:
    ask_id: int


@dataclass
class StatsReply:
    ask_id: int
    stats: dict


@dataclass
class Ready:
    """Scheduler rank 0 or detokenizer -> api: this component can take requests."""

    component: str  # "scheduler" | "detokenizer"
    info: dict = field(default_factory=dict)
