"""The messages that cross processes: small pickled dataclasses, token ids as lists, never tensors.

    api ──AddReq/AbortReq/StatsRequest──▶ scheduler rank 0 ──ReqOutput──▶ detokenizer ──TextOutput──▶ api
    api ──DetokRegister──▶ detokenizer          detokenizer ──AbortReq (stop string hit)──▶ scheduler
    scheduler ──Ready/StatsReply──▶ api          detokenizer ──Ready──▶ api
    scheduler rank 0 ──AddReq/AbortReq/GrammarReady/FlushCache/Shutdown──▶ ranks 1..N-1 (broadcast)

The offline `LLM` hands its scheduler the same AddReq/Shutdown messages in-process. Plain data below the
scheduler and the server alike: the ZMQ sockets that carry them are `server/ipc.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from minisgl.core import Req, TokenLogprob

# ---- to the scheduler (every rank applies them in the same order) ---------------------------------------


@dataclass
class AddReq:
    req: Req


@dataclass
class AbortReq:
    rid: int


@dataclass
class Shutdown:
    pass


@dataclass
class FlushCache:
    """Empty the prefix cache on every rank (nothing may be running): ranks whose caches differed would match
    different prefixes and fall out of step."""


@dataclass
class GrammarReady:
    """Rank 0 to every rank: this request's grammar compilation has ended; admit it (or fail it)."""

    rid: int


class Packed:
    """A dataclass pickled as the tuple of its fields' values (its __init__ sets each one, in order), not as a
    dict of them: a step's outputs, one per running request, pickle ~3x and unpickle ~6x faster, on the
    scheduler's and the api's busiest paths."""

    def __reduce__(self):
        return type(self), tuple(self.__dict__.values())


@dataclass
class StatsRequest:
    ask_id: int


# ---- from the scheduler -----------------------------------------------------------------------------------


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
class StatsReply:
    ask_id: int
    stats: dict


@dataclass
class Ready:
    """Scheduler rank 0 or detokenizer -> api: this component can take requests."""

    component: str  # "scheduler" | "detokenizer"
    info: dict = field(default_factory=dict)


# ---- the detokenizer's --------------------------------------------------------------------------------------


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
