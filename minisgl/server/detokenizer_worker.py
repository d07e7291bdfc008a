"""The detokenizer process: token ids from the scheduler -> UTF-8-safe text deltas for the api.

Stop strings are found here; when one fires, the request is finished towards the client at once and
an abort is sent to the scheduler so its pages are freed. A request this process fails on is finished
with an error in the same way, and the process goes on with the others. Without a tokenizer
(--skip-tokenizer-init) outputs carry token ids only: the text is empty, logprob tokens read "token_id:N".
"""

from __future__ import annotations

import logging
import time

import zmq

from minisgl.core import TokenLogprob
from minisgl.messages import AbortReq, Alternative, DetokRegister, LogprobEntry, Ready, ReqOutput, TextOutput
from minisgl.scheduler.trace import MessageTrace
from minisgl.server.detokenizer import IncrementalDetokenizer, token_text
from minisgl.server.ipc import IpcPaths, become_child, freeze_startup_heap, inbox, outbox
from minisgl.tokenizer import TokenizerSource

logger = logging.getLogger("minisgl.detokenizer")


def run_detokenizer(tokenizer: TokenizerSource | None, ipc: IpcPaths, log_level: str) -> None:
    """The process's body; `tokenizer` is the api's own (launch.py), None with --skip-tokenizer-init."""
    become_child()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s [detokenizer] %(levelname)s %(message)s")
    detokenizer = Detokenizer(None if tokenizer is None else tokenizer.load(), ipc)
    freeze_startup_heap()
    detokenizer.run()


class Detokenizer:
    def __init__(self, tokenizer, ipc: IpcPaths):
        self.tokenizer = tokenizer
        ctx = zmq.Context()
        self.inbox = inbox(ctx, ipc.detokenizer)
        self.to_api = outbox(ctx, ipc.api)
        self.to_scheduler = outbox(ctx, ipc.scheduler)
        self.states: dict[int, IncrementalDetokenizer | None] = {}  # None: no tokenizer, ids only
        self.early: dict[int, list[ReqOutput]] = {}  # outputs that overtook their request's DetokRegister
        self.ended_here: set[int] = set()  # finished by a stop string or a failure; the scheduler's abort is to come
        self.trace = MessageTrace.from_env("detok")  # None unless MINISGL_STEP_TRACE is set

    def run(self) -> None:
        self.to_api.send_pyobj(Ready("detokenizer"))
        while True:
            message = self.inbox.recv_pyobj()
            if isinstance(message, DetokRegister):
                self.states[message.rid] = None if self.tokenizer is None else IncrementalDetokenizer(
                    self.tokenizer, message.stop, message.skip_special_tokens)
                outputs = self.early.pop(message.rid, [])
            else:
                outputs = message
            texts = [text for out in outputs if (text := self.convert_or_fail(out)) is not None]
            if texts:
                if self.trace is not None:  # stamped before the send, as the scheduler's: the API's comes after
                    self.trace.record(time.monotonic(), [text.rid for text in texts])
                self.to_api.send_pyobj(texts)

    def convert_or_fail(self, out: ReqOutput) -> TextOutput | None:
        try:
            return self.convert(out)
        except Exception as exc:
            logger.exception("detokenizing request %d failed; finishing it with an error", out.rid)
            self.states.pop(out.rid, None)
            self.end_here(out)
            return TextOutput(out.rid, "", [], [], "abort", out.prompt_tokens, out.cached_tokens,
                              f"detokenizing the output failed: {type(exc).__name__}", scheduled_at=out.scheduled_at)

    def end_here(self, out: ReqOutput) -> None:
        """The client's answer ends now; if the scheduler is still running the request, stop it."""
        if out.finish_reason is None:
            self.ended_here.add(out.rid)
            self.to_scheduler.send_pyobj(AbortReq(out.rid))

    def convert(self, out: ReqOutput) -> TextOutput | None:
        if out.rid in self.ended_here:  # tokens produced after the answer ended; drop them
            if out.finish_reason is not None:
                self.ended_here.discard(out.rid)
            return None
        if out.rid not in self.states:
            self.early.setdefault(out.rid, []).append(out)
            return None
        state = self.states[out.rid]
        text, finish = "", out.finish_reason
        # The scheduler stops only on a token (EOS or stop_token_ids), the last one it sent.
        matched: str | int | None = out.new_ids[-1] if finish == "stop" and out.new_ids else None
        if state is not None:
            delta = state.add(out.new_ids)
            text = delta.text
            if delta.stopped:
                self.end_here(out)
                finish, matched = "stop", state.matched
            elif finish is not None:
                text += state.flush()
        if finish is not None:
            del self.states[out.rid]
        return TextOutput(out.rid, text, out.new_ids, self.entries(out.logprobs), finish, out.prompt_tokens,
                          out.cached_tokens, out.error,
                          matched, self.entries(out.prompt_logprobs) if out.prompt_logprobs is not None else None,
                          out.scheduled_at, out.hidden_state)

    def entries(self, logprobs: list[TokenLogprob]) -> list[LogprobEntry]:
        return [LogprobEntry(token_text(self.tokenizer, lp.token_id), lp.token_id, lp.logprob,
                             [Alternative(token_text(self.tokenizer, t), v, t) for t, v in lp.top]) for lp in logprobs]
