"""Running a generation request for any front: admit it, check it (boundary), submit its sequences,
gather their outputs, and frame a stream as server-sent events.

Errors after the response has started streaming cannot change its status any more: they arrive as a
last event `data: {"error": {...}}` followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from minisgl.server.boundary import GenerateRequest, PromptInput, prepare
from minisgl.server.engine_client import RequestFailed, Sequence
from minisgl.server.errors import ApiError, error_responses
from minisgl.server.ipc import TextOutput
from minisgl.server.protocol import (
    LogprobEntry,
    PromptTokensDetails,
    SamplingFields,
    StreamOptions,
    Usage,
    VllmExtras,
)
from minisgl.server.state import ServerState

logger = logging.getLogger("minisgl.api")
LOAD_REPORT_FORMAT = "endpoint-load-metrics-format"  # the request header asking for an ORCA load report


class Choice:
    """One generated sequence (prompt p, sample i) and what it has produced so far; `prompt_text` is
    the text its prompt was made of (None for token ids, unless the answer shows it)."""

    def __init__(self, index: int, prompt: int, seq: Sequence, prompt_ids: list[int], prompt_text: str | None):
        self.index, self.prompt, self.seq = index, prompt, seq
        self.prompt_ids, self.prompt_text = prompt_ids, prompt_text
        self.text, self.logprobs, self.token_ids, self.finish = "", [], [], None
        self.matched_stop: str | int | None = None
        self.prompt_logprobs: list[LogprobEntry] | None = None  # prompt tokens 1.., when asked for
        self.hidden_state: list[float] | None = None  # the latest token's, when asked for (return_hidden_states)

    def add(self, out: TextOutput) -> None:
        self.text += out.text
        self.logprobs += out.logprobs
        self.token_ids += out.new_ids
        self.finish = out.finish_reason or self.finish
        self.matched_stop = out.matched_stop if out.matched_stop is not None else self.matched_stop
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.hidden_state is not None:
            self.hidden_state = out.hidden_state

    @property
    def hidden_states(self) -> list[float]:
        """SGLang's `hidden_states` of a choice: the final hidden state its last token was sampled from, or
        nothing ([]) when its only token came from the prompt's prefill (SGLang keeps that one apart)."""
        return self.hidden_state if len(self.token_ids) > 1 and self.hidden_state is not None else []


async def respond(request: Request, state: ServerState, body: SamplingFields, prompt: PromptInput, prompts: int,
                  whole: Callable[[list[Choice], Usage], BaseModel],
                  stream: Callable[[GenerateRequest, list[Choice]], AsyncIterator[BaseModel]] | None) -> Response:
    """Run a generation request and answer it: whole (`whole` builds the response object) or, with
    `stream: true`, as server-sent events of the chunks `stream` yields (None: a route that never streams)."""
    if state.args.tokens_as_token_ids and isinstance(body, VllmExtras):  # vLLM's server-wide default
        body.return_tokens_as_token_ids = True
    if getattr(body, "return_hidden_states", False) and not state.args.return_hidden_states:
        raise ApiError(400, "return_hidden_states needs a server started with --enable-return-hidden-states (as "
                            "SGLang's)", param="return_hidden_states")
    gen, choices = await start(state, body, prompt, prompts)
    load = state.metrics.load_report(request.headers.get(LOAD_REPORT_FORMAT))  # vLLM's ORCA load report
    if body.stream:
        if state.args.force_include_usage:
            body.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)
        return event_stream(stream(gen, choices), load)
    if not await collect(request, state, choices):
        return Response(status_code=499)  # the client hung up; nobody reads this
    return JSONResponse(whole(choices, usage(choices, gen.prompts)).model_dump(mode="json"), headers=load)


async def start(state: ServerState, body: SamplingFields, prompt: PromptInput, prompts: int
                ) -> tuple[GenerateRequest, list[Choice]]:
    """Admit the request (`prompts` x n sequences), check it, and submit every sequence to the engine."""
    client, sequences = state.client, prompts * body.n
    state.admit(body.model, sequences)
    choices: list[Choice] = []
    state.preparing += 1
    try:
        gen = await prepare(state.codec, state.limits, body, prompt)
        state.check_serving()  # draining may have begun while the prompt was tokenized
        for _ in gen.prompts:
            state.metrics.observe_request(gen.n, gen.params.max_tokens)
        for p, ids in enumerate(gen.prompts):
            for i in range(gen.n):
                index = p * gen.n + i
                seed = gen.seed + index if gen.seed is not None else random.getrandbits(63)
                seq = client.submit(ids, gen.params, gen.stop, seed, body.user, gen.cache_salt)
                choices.append(Choice(index, p, seq, ids, gen.prompt_texts[p]))
    finally:
        state.preparing -= 1
        client.release(sequences - len(choices))
    return gen, choices


async def outputs(state: ServerState, choices: list[Choice]) -> AsyncIterator[tuple[Choice, TextOutput]]:
    """Every choice's outputs as they come, each already added to its choice. Leaving early, or a failed
    sequence (raised here as RequestFailed), aborts the ones still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for out in state.client.stream(choice.seq):
                await queue.put((choice, out))
            await queue.put((choice, None))
        except Exception as exc:  # RequestFailed, or a bug: either way the request must not wait forever
            await queue.put((choice, exc))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            choice, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            if out is None:
                remaining -= 1
            else:
                choice.add(out)
                yield choice, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(request: Request, state: ServerState, choices: list[Choice]) -> bool:
    """Run every choice to its end for a whole (non-streamed) answer; False if the client hung up (the
    choices are aborted then). A failed sequence fails the request with its error."""
    async def drain() -> None:
        async for _ in outputs(state, choices):
            pass

    task = asyncio.ensure_future(drain())
    while not task.done():
        await asyncio.wait({task}, timeout=0.2)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return False
    try:
        task.result()
    except RequestFailed as failed:
        raise ApiError(failed.status, failed.message) from None
    return True


def usage(choices: list[Choice], prompts: list[list[int]]) -> Usage:
    cached: dict[int, int] = {}  # per prompt: its choices share the prompt, count its cache hit once
    for c in choices:
        cached[c.prompt] = max(cached.get(c.prompt, 0), c.seq.cached_tokens)
    completion = sum(c.seq.completion_tokens for c in choices)
    return Usage(prompt_tokens=sum(len(p) for p in prompts), completion_tokens=completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())))


def usage_so_far(choice: Choice) -> Usage:
    """One choice's usage so far: what vLLM's continuous_usage_stats puts on each of its chunks."""
    return Usage(prompt_tokens=len(choice.prompt_ids), completion_tokens=len(choice.token_ids),
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=choice.seq.cached_tokens))


def generation_responses(whole: type[BaseModel], chunk: type[BaseModel]) -> dict:
    """A generation route's `responses=` for openapi.json: 200 is the whole response as JSON or, with
    stream: true, server-sent events whose `data` is a chunk or an error as JSON, or `[DONE]` (api.py
    adds the chunk's schema to the components); then the errors it may answer."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                         {"$ref": "#/components/schemas/ErrorResponse"}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}}}
    return {200: {"model": whole, "content": {"text/event-stream": {"schema": event}}},
            **error_responses(400, 401, 404, 413, 500, 503)}


def event_stream(chunks: AsyncIterator[BaseModel], headers: dict[str, str] | None = None) -> StreamingResponse:
    """Server-sent events: one `data:` line per chunk, an error event if the generation fails, then `[DONE]`."""
    async def frames() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
        except RequestFailed as failed:
            yield f"data: {ApiError(failed.status, failed.message).body_json()}\n\n"
        except Exception as exc:  # a bug must still end the stream as the protocol says, not cut it
            logger.exception("stream failed")
            yield f"data: {ApiError(500, f'internal error: {type(exc).__name__}').body_json()}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream", headers=headers)
