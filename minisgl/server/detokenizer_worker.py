"""The detokenizer process: token ids from the scheduler -> UTF-8-safe text deltas for the api.

Stop strings are found here; when one fires, the request is finished towards the client at once and
an abort is sent to the scheduler so its pages are freed.
"""

from __future__ import annotations

import logging

import zmq

from minisgl.scheduler import AbortReq
from minisgl.server.detokenizer import IncrementalDetokenizer
from minisgl.server.ipc import DetokRegister, IpcPaths, Ready, ReqOutput, TextOutput, become_child, inbox, outbox

logger = logging.getLogger("minisgl.detokenizer")


def run_detokenizer(model_path: str, ipc: IpcPaths, log_level: str) -> None:
    become_child()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s [detokenizer] %(levelname)s %(message)s")
    from transformers import AutoTokenizer

    Detokenizer(AutoTokenizer.from_pretrained(model_path), ipc).run()


class Detokenizer:
    def __init__(self, tokenizer, ipc: IpcPaths):
        self.tokenizer = tokenizer
        ctx = zmq.Context()
        self.inbox = inbox(ctx, ipc.detokenizer)
        self.to_api = outbox(ctx, ipc.api)
        self.to_scheduler = outbox(ctx, ipc.scheduler)
        self.states: dict[int, IncrementalDetokenizer] = {}
        self.early: dict[int, list[ReqOutput]] = {}  # outputs that overtook their request's DetokRegister
        self.stopped: set[int] = set()  # ended by a stop string; the scheduler's abort is still to come

    def run(self) -> None:
        self.to_api.send_pyobj(Ready("detokenizer"))
        while True:
            message = self.inbox.recv_pyobj()
            if isinstance(message, DetokRegister):
                self.states[message.rid] = IncrementalDetokenizer(self.tokenizer, message.stop,
                                                                  message.skip_special_tokens)
                outputs = self.early.pop(message.rid, [])
            else:
                outputs = message
            texts = [text for out in outputs if (text := self.convert(out)) is not None]
            if texts:
                self.to_api.send_pyobj(texts)

    def convert(self, out: ReqOutput) -> TextOutput | None:
        if out.rid in self.stopped:  # tokens produced after the stop string; drop them
            if out.finish_reason is not None:
                self.stopped.discard(out.rid)
            return None
        state = self.states.get(out.rid)
        if state is None:
            self.early.setdefault(out.rid, []).append(out)
            return None
        delta = state.add(out.new_ids)
        text, finish = delta.text, out.finish_reason
        if delta.stopped:
            if finish is None:
                self.stopped.add(out.rid)
                self.to_scheduler.send_pyobj(AbortReq(out.rid))
            finish = "stop"
        elif finish is not None:
            text += state.flush()
        if finish is not None:
            del self.states[out.rid]
        decode = self.tokenizer.decode
        logprobs = [(decode([lp.token_id]), lp.logprob, [(decode([t]), v) for t, v in lp.top]) for lp in out.logprobs]
        return TextOutput(out.rid, text, out.new_ids, logprobs, finish, out.prompt_tokens, out.cached_tokens)
