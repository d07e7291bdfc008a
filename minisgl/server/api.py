"""The OpenAI-compatible HTTP front: validation, tokenization, streaming, health, metrics.

Every failure is answered at once with OpenAI-style JSON ({"error": {message, type, param, code}}):
400 for bad parameters, schema errors and malformed JSON; 401 wrong API key; 404 unknown model;
503 (with Retry-After) while loading, draining or when the waiting queue is full.
"""

from __future__ import annotations

import asyncio
import logging
import random
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from minisgl.core import ContextLengthError, SamplingParams, check_prompt
from minisgl.server import protocol as P
from minisgl.server.args import ServerArgs
from minisgl.server.engine_client import EngineClient, Finished
from minisgl.server.ipc import IpcPaths, TextOutput
from minisgl.server.metrics import Metrics

logger = logging.getLogger("minisgl.api")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after else None
    return JSONResponse(P.error_body(err.message, err.type, err.param, err.code), err.status, headers=headers)


class ServerState:
    """What the endpoints share: settings, the engine client, metrics, the tokenizer, the drain flag."""

    def __init__(self, args: ServerArgs, ipc: IpcPaths):
        from transformers import AutoTokenizer

        self.args = args
        self.metrics = Metrics(args.served_model_name)
        self.client = EngineClient(ipc, self.metrics)
        self.tokenizer = AutoTokenizer.from_pretrained(args.engine.model)
        self.draining = False
        self.children: dict[str, int] = {}  # child process name -> pid, for operators (and tests)

    @property
    def max_seq_len(self) -> int:
        return self.client.info["max_seq_len"]

    def admit(self, model: str) -> None:
        """Refuse a new generation request that cannot be served now."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", "service_unavailable", retry_after=5)
        if not self.client.ready.is_set():
            raise ApiError(503, "the model is still loading", "service_unavailable", retry_after=5)
        if model != self.args.served_model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{self.args.served_model_name}'", "not_found_error", "model", "model_not_found")
        if self.client.queued >= self.args.max_queued_requests:
            raise ApiError(503, f"too many queued requests ({self.client.queued}); try again later",
                           "service_unavailable", retry_after=1)

    def check_prompt(self, ids: list[int], param: str) -> None:
        info = self.client.info
        try:
            check_prompt(ids, info["vocab_size"], info["max_seq_len"], info["kv_capacity_tokens"])
        except ValueError as exc:
            code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
            raise ApiError(400, str(exc), param=param, code=code) from None

    def sampling_params(self, body, ids: list[int]) -> SamplingParams:
        try:
            return P.to_sampling_params(body, self.max_seq_len - len(ids))
        except P.ProtocolError as exc:
            raise ApiError(400, exc.message, param=exc.param) from None


def build_app(state: ServerState) -> FastAPI:
    client, tokenizer = state.client, state.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(client.run()), asyncio.create_task(announce_ready(state))]  # kept: not GC'd
        yield
        for task in tasks:
            task.cancel()

    app = FastAPI(title="minisgl", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(P.ProtocolError)
    async def on_protocol_error(request: Request, exc: P.ProtocolError):
        return error_response(ApiError(400, exc.message, param=exc.param))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # loc holds a byte offset, not a field
            detail = first.get("ctx", {}).get("error", "")
            return error_response(ApiError(400, f"malformed JSON body: {detail}".rstrip(": ")))
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(where) + ': ' if where else ''}{first.get('msg', 'invalid request')}"
        return error_response(ApiError(400, message, param=where[0] if where else None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}", "internal_error"))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(exc.status_code, str(exc.detail), kind))

    if state.args.api_key:
        app.add_middleware(ApiKeyCheck, key=state.args.api_key)

    @app.get("/health")
    async def health():
        if state.draining or not client.ready.is_set():
            status = "draining" if state.draining else "loading"
            return JSONResponse({"status": status}, 503, headers={"Retry-After": "5"})
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        if state.draining or not client.ready.is_set():
            return JSONResponse({"status": "unavailable"}, 503)
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        try:
            await asyncio.wait_for(drain(client.generate([0], params, [], 0, [])), timeout=30)
        except asyncio.TimeoutError:
            return JSONResponse({"status": "generation timed out"}, 503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        info = client.info
        card = P.ModelCard(id=state.args.served_model_name, max_model_len=info.get("max_seq_len"))
        return P.ModelList(data=[card]).model_dump()

    @app.get("/metrics")
    async def metrics():
        if client.ready.is_set():
            try:
                state.metrics.update_scheduler(await client.stats(timeout=2))
            except asyncio.TimeoutError:
                logger.warning("scheduler stats timed out; serving the last known values")
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/get_server_info")
    async def server_info():
        stats = await client.stats() if client.ready.is_set() else {}
        engine = vars(state.args.engine)
        return {**engine, "served_model_name": state.args.served_model_name, **client.info, "scheduler": stats,
                "draining": state.draining, "children": state.children}

    @app.post("/tokenize")
    async def tokenize(body: dict):
        if "messages" in body:
            try:
                messages = P.TokenizeChat.model_validate(body).messages
            except ValidationError as exc:
                raise ApiError(400, f"messages: {exc.errors()[0]['msg']}", param="messages") from None
            ids = apply_chat_template(tokenizer, messages)
        elif isinstance(body.get("prompt"), str):
            ids = tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
        else:
            raise ApiError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": client.info.get("max_seq_len")}

    @app.post("/detokenize")
    async def detokenize(body: dict):
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ApiError(400, "'tokens' must be a list of non-negative integers", param="tokens")
        return {"prompt": tokenizer.decode(ids)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        state.admit(body.model)
        ids = await asyncio.to_thread(apply_chat_template, tokenizer, body.messages)
        state.check_prompt(ids, "messages")
        params = state.sampling_params(body, ids)
        return await respond(state, request, body, [ids], params, chat=True)

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        state.admit(body.model)
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        prompts = body.prompts()
        batch = [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p)
                 for p in prompts]
        for ids in batch:
            state.check_prompt(ids, "prompt")
        params = state.sampling_params(body, max(batch, key=len))
        return await respond(state, request, body, batch, params, chat=False)

    return app


class ApiKeyCheck:
    """401 for /v1 requests without `Authorization: Bearer KEY`. Plain ASGI on purpose: Starlette's
    BaseHTTPMiddleware wraps `receive` and hides client disconnects from the endpoints."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and \
                dict(scope["headers"]).get(b"authorization") != self.expected:
            error = ApiError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
            return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


def apply_chat_template(tokenizer, messages: list[P.ChatMessage]) -> list[int]:
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def announce_ready(state: ServerState) -> None:
    await state.client.ready.wait()
    info = state.client.info
    logger.info("ready: model=%s dtype=%s device=%s tp=%d kv_capacity=%d tokens max_seq_len=%d on %s:%d",
                state.args.served_model_name, info["dtype"], info["device"], info["tp_size"],
                info["kv_capacity_tokens"], info["max_seq_len"], state.args.host, state.args.port)


async def drain(stream: AsyncIterator) -> list:
    return [item async for item in stream]


# ---- generation ----------------------------------------------------------------------------------

class Choice:
    """One generated sequence (prompt p, sample i) and its accumulated result."""

    def __init__(self, index: int, prompt: int):
        self.index, self.prompt = index, prompt
        self.text, self.logprobs, self.finish = "", [], None
        self.done: list[Finished] = []


async def fan_in(state: ServerState, choices: list[Choice], prompts: list[list[int]], params: SamplingParams,
                 stop: list[str], seed: int | None) -> AsyncIterator[tuple[Choice, TextOutput]]:
    """Run every choice concurrently and yield their outputs as they come; leaving early cancels (and so
    aborts) the ones still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        choice_seed = seed + choice.index if seed is not None else random.getrandbits(63)
        async for out in state.client.generate(prompts[choice.prompt], params, stop, choice_seed, choice.done):
            await queue.put((choice, out))
        await queue.put((choice, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            choice, out = await queue.get()
            if out is None:
                remaining -= 1
            else:
                yield choice, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(choices: list[Choice], prompts: list[list[int]]) -> P.Usage:
    finished = [(c, c.done[0]) for c in choices if c.done]
    cached: dict[int, int] = {}  # per prompt: its choices share the prompt, count its cache hit once
    for c, d in finished:
        cached[c.prompt] = max(cached.get(c.prompt, 0), d.cached_tokens)
    completion = sum(d.completion_tokens for _, d in finished)
    prompt_tokens = sum(len(p) for p in prompts)
    return P.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                   prompt_tokens_details=P.PromptTokensDetails(cached_tokens=sum(cached.values())))


def logprobs_payload(entries: list, chat: bool, offset: int = 0) -> dict | None:
    if not entries:
        return None
    return P.chat_logprobs(entries) if chat else P.completion_logprobs(entries, offset)


async def respond(state: ServerState, request: Request, body, prompts: list[list[int]], params: SamplingParams,
                  chat: bool):
    choices = [Choice(p * body.n + i, p) for p in range(len(prompts)) for i in range(body.n)]
    stream = fan_in(state, choices, prompts, params, P.stop_strings(body), body.seed)
    model = state.args.served_model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(sse(stream, choices, prompts, model, chat, include_usage),
                                 media_type="text/event-stream")
    collect = asyncio.ensure_future(collect_all(stream))
    while not collect.done():  # a client that hangs up aborts its request
        await asyncio.wait({collect}, timeout=0.2)
        if not collect.done() and await request.is_disconnected():
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
            return Response(status_code=499)
    collect.result()
    if chat:
        return P.ChatCompletionResponse(model=model, usage=usage(choices, prompts), choices=[
            P.ChatChoice(index=c.index, message=P.ChatResponseMessage(content=c.text),
                         logprobs=logprobs_payload(c.logprobs, True), finish_reason=c.finish) for c in choices]
        ).model_dump()
    return P.CompletionResponse(model=model, usage=usage(choices, prompts), choices=[
        P.CompletionChoice(index=c.index, text=c.text, logprobs=logprobs_payload(c.logprobs, False),
                           finish_reason=c.finish) for c in choices]).model_dump()


async def collect_all(stream: AsyncIterator[tuple[Choice, TextOutput]]) -> None:
    async for choice, out in stream:
        choice.text += out.text
        choice.logprobs += out.logprobs
        choice.finish = out.finish_reason or choice.finish


async def sse(stream, choices: list[Choice], prompts: list[list[int]], model: str, chat: bool,
              include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, then `data: [DONE]`."""
    def event(obj) -> str:
        return f"data: {obj.model_dump_json()}\n\n"

    chunk_id = (P.ChatCompletionChunk if chat else P.CompletionChunk)(model=model, choices=[]).id
    if chat:
        for c in choices:
            yield event(P.ChatCompletionChunk(id=chunk_id, model=model, choices=[
                P.ChatChunkChoice(index=c.index, delta=P.DeltaMessage(role="assistant", content=""))]))
    async for choice, out in stream:
        offset = len(choice.text)
        choice.text += out.text
        choice.finish = out.finish_reason
        logprobs = logprobs_payload(out.logprobs, chat, offset)
        if not out.text and not out.finish_reason and logprobs is None:
            continue
        if chat:
            yield event(P.ChatCompletionChunk(id=chunk_id, model=model, choices=[P.ChatChunkChoice(
                index=choice.index, delta=P.DeltaMessage(content=out.text), logprobs=logprobs,
                finish_reason=out.finish_reason)]))
        else:
            yield event(P.CompletionChunk(id=chunk_id, model=model, choices=[P.CompletionChoice(
                index=choice.index, text=out.text, logprobs=logprobs, finish_reason=out.finish_reason)]))
    if include_usage:
        chunk = P.ChatCompletionChunk if chat else P.CompletionChunk
        yield event(chunk(id=chunk_id, model=model, choices=[], usage=usage(choices, prompts)))
    yield "data: [DONE]\n\n"
