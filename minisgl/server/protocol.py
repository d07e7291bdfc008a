"""OpenAI-compatible request and response models, and their conversion to SamplingParams.

Parsing is pydantic's job (wrong types become ValidationError); the rules pydantic cannot express
with the parameter's name attached (ranges, combinations, content parts) raise ProtocolError, which
the server turns into an OpenAI-style 400 naming `param`.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_serializer

from minisgl.core import SamplingParams

MAX_N = 16
MAX_STOP_STRINGS = 16


class ProtocolError(ValueError):
    """A request the API rejects; `param` names the offending request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class _Request(BaseModel):
    # Clients send fields we do not implement (tools, logit_bias, ...); ignoring them keeps them working.
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------- requests


class ContentPart(_Request):
    """One part of a message's content; only {"type": "text"} is served (checked in ChatMessage.text)."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message as plain text; raises ProtocolError for non-text parts (images, audio...)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if any(part.type != "text" or part.text is None for part in self.content):
            raise ProtocolError("only text content parts are supported", "messages")
        return "".join(part.text for part in self.content)


class TokenizeChat(_Request):
    """POST /tokenize with a conversation: its token ids after the chat template."""

    messages: list[ChatMessage] = Field(min_length=1)


class StreamOptions(_Request):
    include_usage: bool = False


class _GenerationRequest(_Request):
    """Fields shared by chat and text completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    user: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a batch: one string per prompt, or one token-id list per prompt."""
        p = self.prompt
        batch = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else p
        if not batch or any(len(one) == 0 for one in batch):
            raise ProtocolError("prompt must not be empty", "prompt")
        return batch


def stop_strings(req: _GenerationRequest) -> list[str]:
    """`stop` as a list; the server matches these on decoded text."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ProtocolError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise ProtocolError("stop strings must not be empty", "stop")
    return stops


def to_sampling_params(req: ChatCompletionRequest | CompletionRequest, max_new_tokens_limit: int) -> SamplingParams:
    """Validate `req` and build its SamplingParams; `max_new_tokens_limit` is the room left in the context."""
    chat = isinstance(req, ChatCompletionRequest)
    if not 1 <= req.n <= MAX_N:
        raise ProtocolError(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    stop_strings(req)

    if chat and req.max_completion_tokens is not None:
        max_field, requested = "max_completion_tokens", req.max_completion_tokens
    else:
        max_field, requested = "max_tokens", req.max_tokens
    if requested is not None and requested < 1:
        raise ProtocolError(f"{max_field} must be an integer >= 1, got {requested}", max_field)
    if max_new_tokens_limit < 1:
        raise ProtocolError("the prompt fills the whole context window", "messages" if chat else "prompt")
    max_tokens = max_new_tokens_limit if requested is None else min(requested, max_new_tokens_limit)

    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise ProtocolError("top_logprobs requires logprobs=true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    try:
        return SamplingParams(
            temperature=pick(req.temperature, 1.0),
            top_p=pick(req.top_p, 1.0),
            top_k=pick(req.top_k, -1),
            min_p=pick(req.min_p, 0.0),
            max_tokens=max_tokens,
            # Clamped like max_tokens, so a request valid on its own is not refused for a long prompt.
            min_tokens=min(pick(req.min_tokens, 0), max_new_tokens_limit),
            ignore_eos=req.ignore_eos,
            stop_token_ids=pick(req.stop_token_ids, []),
            seed=req.seed,
            presence_penalty=pick(req.presence_penalty, 0.0),
            frequency_penalty=pick(req.frequency_penalty, 0.0),
            repetition_penalty=pick(req.repetition_penalty, 1.0),
            logprobs=logprobs,
        )
    except ValueError as e:
        # The message starts with the SamplingParams field, which matches the request field except
        # for chat's top_logprobs (max_tokens was checked above under the name the user set).
        field = str(e).split(" ", 1)[0]
        param = "top_logprobs" if chat and field == "logprobs" else field
        raise ProtocolError(str(e).replace(field, param, 1), param) from e


# ---------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @computed_field
    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class _Envelope(BaseModel):
    """The head every response object shares, in OpenAI's field order; subclasses set id and object."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str


def _new_id(prefix: str) -> Any:
    return Field(default_factory=lambda: f"{prefix}-{uuid.uuid4().hex}")


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Envelope):
    id: str = _new_id("chatcmpl")
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: Any) -> dict:
        # A delta carries only what changed: the first chunk the role, later ones the new text.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: dict | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Envelope):
    id: str = _new_id("chatcmpl")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None = None
    finish_reason: str | None = None


class CompletionResponse(_Envelope):
    id: str = _new_id("cmpl")
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Envelope):
    id: str = _new_id("cmpl")
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "minisgl"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code)).model_dump()


# ---------------------------------------------------------------- logprobs payloads

LogprobEntry = tuple[str, float, list[tuple[str, float]]]  # (token, logprob, [(alt token, logprob)])


def _lp(value: float) -> float:
    # JSON has no -inf (Starlette refuses to encode it); a masked-out alternative gets a floor instead.
    return value if math.isfinite(value) else -9999.0


def chat_logprobs(entries: list[LogprobEntry]) -> dict:
    """The chat `logprobs` object: per token its logprob, UTF-8 bytes and top alternatives."""

    def item(token: str, lp: float) -> dict:
        return {"token": token, "logprob": _lp(lp), "bytes": list(token.encode("utf-8"))}

    return {"content": [item(tok, lp) | {"top_logprobs": [item(t, alt) for t, alt in top]} for tok, lp, top in entries]}


def completion_logprobs(entries: list[LogprobEntry], text_offset_start: int = 0) -> dict:
    """The legacy completions `logprobs` object; `text_offset` counts characters into the returned text."""
    offsets, pos = [], text_offset_start
    for token, _, _ in entries:
        offsets.append(pos)
        pos += len(token)
    return {
        "tokens": [tok for tok, _, _ in entries],
        "token_logprobs": [_lp(lp) for _, lp, _ in entries],
        "top_logprobs": [{t: _lp(alt) for t, alt in top} for _, _, top in entries],
        "text_offset": offsets,
    }
