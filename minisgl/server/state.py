"""What every route shares: settings, the engine client, the tokenizer, metrics, and admission."""

from __future__ import annotations

from fastapi import Request

from minisgl.models.config import ModelConfig
from minisgl.server.args import ServerArgs
from minisgl.server.boundary import ModelLimits
from minisgl.server.engine_client import EngineClient
from minisgl.server.errors import ApiError
from minisgl.server.ipc import IpcPaths
from minisgl.server.metrics import Metrics
from minisgl.server.parsers.reasoning import REASONING_PARSERS
from minisgl.server.text import TextCodec


class ServerState:
    def __init__(self, args: ServerArgs, ipc: IpcPaths, tokenizer):
        self.args = args
        self.metrics = Metrics(args.served_model_name, args.metrics_naming)
        self.client = EngineClient(ipc, self.metrics)
        self.codec = TextCodec(tokenizer)
        self.vocab_size = ModelConfig.from_dir(args.engine.model).vocab_size  # known before the engine is up
        # The reasoning parser's markers as token ids: what a thinking budget counts from and forces.
        markers = REASONING_PARSERS.get(args.reasoning_parser)
        self.thinking_markers = tuple(tuple(tokenizer.encode(m, add_special_tokens=False)) for m in markers) \
            if markers and tokenizer is not None else None
        self.preparing = 0  # admitted requests still being checked and tokenized (not yet submitted)
        self.draining = False
        self.children: dict[str, int] = {}  # child process name -> pid, for operators (and tests)

    @property
    def busy(self) -> bool:
        """Requests are still in the server: being prepared, or generating."""
        return bool(self.preparing or self.client.open_sequences)

    @property
    def limits(self) -> ModelLimits:
        info = self.client.info
        return ModelLimits(info["vocab_size"], info["max_seq_len"], info["kv_capacity_tokens"],
                           self.args.logprobs_cap(info["vocab_size"]), self.thinking_markers)

    def check_serving(self) -> None:
        """503 unless new work can start now (ready, not draining)."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", retry_after=5)
        if not self.client.ready.is_set():
            raise ApiError(503, "the model is still loading", retry_after=5)

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is the served one (None: the request left it out, as vLLM and SGLang allow)."""
        if model is not None and model != self.args.served_model_name:
            raise ApiError(404, f"the model {model[:200]!r} does not exist; this server serves "
                                f"'{self.args.served_model_name}'", param="model", code="model_not_found")

    def admit(self, model: str | None, sequences: int) -> None:
        """Admit a generation request of `sequences` sequences (prompts x n) for `model` (None: the served
        one) or refuse it now. Once admitted, the caller submits them all or releases the rest (client.release)."""
        self.check_serving()
        self.check_model(model)
        limit = self.args.max_queued_requests
        if sequences > limit:
            raise ApiError(400, f"this request asks for {sequences} sequences (prompts x n) but at most {limit} "
                                f"can wait at once (--max-queued-requests)", param="n", code="too_many_sequences")
        if not self.client.admit(sequences, limit):
            raise ApiError(503, f"too many queued requests ({self.client.queued}); try again later", retry_after=1)


async def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the ServerState this app was built with. Async so that FastAPI calls it on the loop:
    a plain function would be run on a worker thread, a GIL hand-off of up to 5 ms per request while the loop
    streams (a burst of requests then waits for them one after another)."""
    return request.app.state.server
