"""The one pipeline every generation API runs on: admit a plan, check it (boundary), submit its sequences,
gather their outputs, and give them back through the API's `Answer`: whole as JSON, streamed as server-sent
events (sse.py), or generated behind (Responses' background)."""

from __future__ import annotations

import asyncio
import random
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from minisgl.messages import LogprobEntry, TextOutput
from minisgl.server.boundary import CheckedRequest, prepare
from minisgl.server.engine_client import Sequence
from minisgl.server.errors import ApiError, error_responses
from minisgl.server.plan import Output, Plan
from minisgl.server.schemas.logprobs import PromptLogprobs, vllm_prompt_logprobs
from minisgl.server.schemas.types import Envelope, PromptTokensDetails, Usage
from minisgl.server.sse import Event, event_stream
from minisgl.server.state import ServerState

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


class Answer:
    """How one API gives a run back: the whole answer, or the events of its stream (`named`: Responses'
    `event:` framing, else `data:` chunks), and the stream's last event when the generation fails."""

    named = False

    def whole(self, choices: list[Choice], usage: Usage) -> BaseModel:
        raise NotImplementedError

    def stream(self, checked: CheckedRequest, choices: list[Choice]) -> AsyncIterator[Event]:
        raise NotImplementedError

    def failed(self, error: ApiError) -> Event:
        """A failure mid-stream: the error body as a last chunk (then `[DONE]`), as vLLM and SGLang send it."""
        return error.response_model()

    def behind(self, state: ServerState, checked: CheckedRequest, choices: list[Choice]) -> Response:
        """Answer at once and generate behind (Responses' background)."""
        raise NotImplementedError


async def respond(request: Request, state: ServerState, plan: Plan, answer: Answer) -> Response:
    """Run a request plan and answer it, whole, streamed or (background) at once."""
    output = plan.output
    output.tokens_as_ids |= state.args.tokens_as_token_ids  # vLLM's server-wide default
    if output.stream and state.args.force_include_usage:
        output.include_usage = output.continuous_usage = True
    if output.hidden_states and not state.args.return_hidden_states:
        raise ApiError(400, "return_hidden_states needs a server started with --enable-return-hidden-states (as "
                            "SGLang's)", param="return_hidden_states")
    checked, choices = await start(state, plan)
    load = state.metrics.load_report(request.headers.get(LOAD_REPORT_FORMAT))  # vLLM's ORCA load report
    if output.background:
        return answer.behind(state, checked, choices)
    if output.stream:
        return event_stream(answer.stream(checked, choices), answer.failed, answer.named, load)
    if not await collect(request, state, choices):
        return Response(status_code=499)  # the client hung up; nobody reads this
    return JSONResponse(answer.whole(choices, usage(choices, checked.prompts)).model_dump(mode="json"), headers=load)


async def start(state: ServerState, plan: Plan) -> tuple[CheckedRequest, list[Choice]]:
    """Admit the plan (prompts x n sequences), check it, and submit every sequence to the engine."""
    client, sequences = state.client, plan.prompts * plan.n
    await client.streams_first()  # the running streams' waiting chunks go out before this request's work
    state.admit(plan.model, sequences)
    choices: list[Choice] = []
    state.preparing += 1
    try:
        checked = await prepare(state.codec, state.limits, plan)
        state.check_serving()  # draining may have begun while the prompt was tokenized
        for _ in checked.prompts:
            state.metrics.observe_request(checked.n, checked.params.max_tokens)
        for p, ids in enumerate(checked.prompts):
            for i in range(checked.n):
                index = p * checked.n + i
                seed = checked.seed + index if checked.seed is not None else random.getrandbits(63)
                seq = client.submit(ids, checked.params, checked.stop, seed, plan.user, checked.cache_salt)
                choices.append(Choice(index, p, seq, ids, checked.prompt_texts[p]))
    finally:
        state.preparing -= 1
        client.release(sequences - len(choices))
    return checked, choices


async def outputs(state: ServerState, choices: list[Choice]) -> AsyncIterator[tuple[Choice, TextOutput]]:
    """Every choice's outputs as they come (EngineClient.streams: what a choice received since the last read comes
    as one output), each already added to its choice. Leaving early, or a failed sequence (raised here as
    RequestFailed), aborts the ones still running."""
    by_rid = {c.seq.rid: c for c in choices}
    async with aclosing(state.client.streams([c.seq for c in choices])) as streamed:
        async for seq, out in streamed:
            choice = by_rid[seq.rid]
            choice.add(out)
            yield choice, out


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
    task.result()  # a failed sequence raises its RequestFailed: an ApiError
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


class Chunks:
    """What every chunked stream (chat, completions) shares: one id on all its chunks, a choice's usage so far
    on each (continuous_usage), and the usage chunk that ends it (include_usage)."""

    def __init__(self, kind: type[Envelope], model: str, output: Output, prompt_logprobs: int | None = None):
        self.kind, self.model, self.output = kind, model, output
        self.id = kind(model=model, choices=[]).id
        self.prompt_logprob_count, self.scored = prompt_logprobs, set()  # choices whose prompt logprobs went out

    def chunk(self, choices: list[BaseModel], of: Choice | None = None, **fields: Any) -> Envelope:
        """A chunk of `choices`, with the usage so far of choice `of` when asked for."""
        so_far = usage_so_far(of) if of is not None and self.output.continuous_usage else None
        return self.kind(id=self.id, model=self.model, choices=choices, usage=so_far, **fields)

    def prompt_logprobs(self, choice: Choice) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs of `choice`, when asked for: on the first chunk of its output, None after."""
        if choice.index in self.scored:
            return None
        self.scored.add(choice.index)
        return vllm_prompt_logprobs(choice.prompt_logprobs, self.prompt_logprob_count)

    def hidden_states(self, choice: Choice, out: TextOutput, make: Callable[[int, list[float]], BaseModel]
                      ) -> list[Envelope]:
        """SGLang's return_hidden_states: after a choice's last chunk, one of its own with the hidden state
        (`make` builds the API's choice of it)."""
        return [self.chunk([make(choice.index, choice.hidden_states)])] \
            if out.finish_reason and self.output.hidden_states else []

    def last(self, checked: CheckedRequest, choices: list[Choice]) -> list[Envelope]:
        """The usage chunk, when asked for."""
        return [self.kind(id=self.id, model=self.model, choices=[], usage=usage(choices, checked.prompts))
                ] if self.output.include_usage else []


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
