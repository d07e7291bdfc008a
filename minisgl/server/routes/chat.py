"""POST /v1/chat/completions: its request schema, its route, its response and its stream of chunks."""

from __future__ import annotations

from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, model_validator

from minisgl.server.boundary import Conversation, GenerateRequest
from minisgl.server.errors import ApiError
from minisgl.server.generation import Choice, generation_responses, outputs, respond, usage
from minisgl.server.protocol import (
    MAX_LOGPROBS,
    ChatLogprobs,
    Envelope,
    SamplingFields,
    StrictRequest,
    Text,
    Usage,
    chat_logprobs,
    integer,
    new_id,
)
from minisgl.server.state import ServerState, server_state

router = APIRouter()


# ---------------------------------------------------------------- request


class ContentPart(StrictRequest):
    """One part of a message's content; only text parts are served."""

    type: Literal["text"]
    text: Text


class ChatMessage(StrictRequest):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        """Say plainly that images, audio... are not served (the schema's own error would be obscure)."""
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            kinds = [part.get("type") for part in data["content"] if isinstance(part, dict)]
            if any(kind != "text" for kind in kinds):
                raise ValueError(f"only text content parts are supported, got types {kinds!r}")
        return data

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: integer(ge=1) | None = None
    max_completion_tokens: integer(ge=1) | None = Field(None, description="wins over max_tokens")
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(None, description="needs logprobs: true")

    def sampling(self) -> tuple[dict[str, Any], dict[str, str]]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        by_completion = self.max_completion_tokens is not None
        values = self.shared_sampling() | {
            "max_tokens": self.max_completion_tokens if by_completion else self.max_tokens,
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None}
        renamed = {"logprobs": "top_logprobs"} | ({"max_tokens": "max_completion_tokens"} if by_completion else {})
        return values, renamed


# ---------------------------------------------------------------- response


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(Envelope):
    id: str = new_id("chatcmpl")
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """A delta carries only what changed: the first chunk the role, later ones the new text."""

    role: Literal["assistant"] | None = Field(None, exclude_if=lambda v: v is None)
    content: str | None = Field(None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Envelope):
    id: str = new_id("chatcmpl")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------- route


@router.post("/v1/chat/completions", response_model=None,
             responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk))
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           state: ServerState = Depends(server_state)) -> Response:
    conversation = Conversation([{"role": m.role, "content": m.text()} for m in body.messages])
    model = state.args.served_model_name

    def whole(choices: list[Choice], usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(model=model, usage=usage, choices=[
            ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                       logprobs=chat_logprobs(c.logprobs) if c.logprobs else None, finish_reason=c.finish)
            for c in choices])

    return await respond(request, state, body, conversation, 1, whole,
                         lambda gen, choices: chunks(state, body, gen, choices, model))


async def chunks(state: ServerState, body: ChatCompletionRequest, gen: GenerateRequest, choices: list[Choice],
                 model: str) -> AsyncIterator[ChatCompletionChunk]:
    chunk_id = ChatCompletionChunk(model=model, choices=[]).id
    for c in choices:
        yield ChatCompletionChunk(id=chunk_id, model=model, choices=[
            ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
    async for choice, out in outputs(state, choices):
        if out.text or out.finish_reason or out.logprobs:
            yield ChatCompletionChunk(id=chunk_id, model=model, choices=[ChatChunkChoice(
                index=choice.index, delta=DeltaMessage(content=out.text),
                logprobs=chat_logprobs(out.logprobs) if out.logprobs else None, finish_reason=out.finish_reason)])
    if body.include_usage:
        yield ChatCompletionChunk(id=chunk_id, model=model, choices=[], usage=usage(choices, gen.prompts))
