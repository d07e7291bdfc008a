"""POST /v1/completions: its request schema, its route, its response and its stream of chunks.

The prompt is text, token ids, or a batch of either. Without a tokenizer (--skip-tokenizer-init) only
token ids are accepted, `text` is empty and each choice carries `token_ids` instead.
"""

from __future__ import annotations

from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import AfterValidator, BaseModel, Field

from minisgl.server.boundary import GenerateRequest
from minisgl.server.generation import Choice, generation_responses, outputs, respond, usage
from minisgl.server.protocol import (
    MAX_LOGPROBS,
    CompletionLogprobs,
    Envelope,
    NonEmptyText,
    SamplingFields,
    TokenId,
    Usage,
    completion_logprobs,
    integer,
    new_id,
)
from minisgl.server.state import ServerState, server_state

router = APIRouter()

def _no_echo(echo: bool) -> bool:
    if echo:
        raise ValueError("echo is not supported")
    return echo


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: integer(ge=1) | None = 16  # OpenAI's default for /v1/completions
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    echo: Annotated[bool, AfterValidator(_no_echo)] = Field(False, json_schema_extra={"const": False},
                                                            description="echoing the prompt is not supported")

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a batch: one string per prompt, or one token-id list per prompt."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else p

    def sampling(self) -> tuple[dict[str, Any], dict[str, str]]:
        return self.shared_sampling() | {"max_tokens": self.max_tokens, "logprobs": self.logprobs}, {}


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None,
                                        description="the output's token ids; only with --skip-tokenizer-init")


class CompletionResponse(Envelope):
    id: str = new_id("cmpl")
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Envelope):
    id: str = new_id("cmpl")
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


@router.post("/v1/completions", response_model=None,
             responses=generation_responses(CompletionResponse, CompletionChunk))
async def completions(body: CompletionRequest, request: Request,
                      state: ServerState = Depends(server_state)) -> Response:
    batch = body.prompts()
    model, ids_only = state.args.served_model_name, state.codec.tokenizer is None

    def whole(choices: list[Choice], usage: Usage) -> CompletionResponse:
        return CompletionResponse(model=model, usage=usage, choices=[CompletionChoice(
            index=c.index, text=c.text, logprobs=completion_logprobs(c.logprobs) if c.logprobs else None,
            finish_reason=c.finish, token_ids=c.token_ids if ids_only else None) for c in choices])

    return await respond(request, state, body, batch, len(batch), whole,
                         lambda gen, choices: chunks(state, body, gen, choices, model, ids_only))


async def chunks(state: ServerState, body: CompletionRequest, gen: GenerateRequest, choices: list[Choice],
                 model: str, ids_only: bool) -> AsyncIterator[CompletionChunk]:
    chunk_id = CompletionChunk(model=model, choices=[]).id
    async for choice, out in outputs(state, choices):
        if out.text or out.finish_reason or out.logprobs or (ids_only and out.new_ids):
            offset = len(choice.text) - len(out.text)
            yield CompletionChunk(id=chunk_id, model=model, choices=[CompletionChoice(
                index=choice.index, text=out.text, finish_reason=out.finish_reason,
                logprobs=completion_logprobs(out.logprobs, offset) if out.logprobs else None,
                token_ids=out.new_ids if ids_only else None)])
    if body.include_usage:
        yield CompletionChunk(id=chunk_id, model=model, choices=[], usage=usage(choices, gen.prompts))
