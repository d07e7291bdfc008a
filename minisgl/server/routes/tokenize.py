"""POST /tokenize and POST /detokenize (vLLM's and SGLang's extensions).

Both run off the event loop, like generation's tokenization. /tokenize returns at most a context's worth
of ids (a longer text is answered 400 with its token count: millions of ids would only stall the
server); /detokenize checks its ids against the vocabulary."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from minisgl.core import check_token_ids
from minisgl.server.errors import ApiError, error_responses
from minisgl.server.protocol import StrictRequest, Text, TokenId
from minisgl.server.routes.chat import ChatMessage, TemplateOptions
from minisgl.server.state import ServerState, server_state
from minisgl.server.text import Conversation

router = APIRouter()


class TokenizeText(StrictRequest):
    prompt: Text


class TokenizeChat(TemplateOptions):
    """A conversation: its token ids after the chat template, as /v1/chat/completions would see them."""

    messages: list[ChatMessage] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _not_also_a_prompt(cls, data: Any) -> Any:
        """The schema is one of the two shapes: a body with both would be silently half-ignored."""
        if isinstance(data, dict) and "prompt" in data:
            raise ValueError("give either prompt or messages, not both")
        return data


def _which(body: object) -> str:
    return "TokenizeChat" if isinstance(body, dict) and "messages" in body else "TokenizeText"


# A body with `messages` is a conversation, any other a text: errors then speak of the fields it sent.
TokenizeRequest = Annotated[Annotated[TokenizeText, Tag("TokenizeText")] | Annotated[TokenizeChat, Tag("TokenizeChat")],
                            Discriminator(_which)]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(StrictRequest):
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 401, 413, 503))
async def tokenize(body: TokenizeRequest, state: ServerState = Depends(server_state)) -> TokenizeResponse:
    state.check_serving()
    param = "prompt" if isinstance(body, TokenizeText) else "messages"
    state.codec.require(param, "there is nothing to tokenize with")
    limits = state.limits
    if isinstance(body, TokenizeText):
        count, ids = await state.codec.encode(body.prompt, limits.max_seq_len)
    else:
        conversation = Conversation([m.template_form() for m in body.messages], **body.template_options())
        count, ids, _ = await state.codec.encode_chat(conversation, limits.max_seq_len)
    if count > limits.max_seq_len:
        raise ApiError(400, f"the text has {count} tokens, more than this model's context of {limits.max_seq_len}",
                       param=param, code="context_length_exceeded")
    return TokenizeResponse(tokens=ids, count=count, max_model_len=limits.max_seq_len)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 401, 413, 503))
async def detokenize(body: DetokenizeRequest, state: ServerState = Depends(server_state)) -> DetokenizeResponse:
    state.check_serving()
    state.codec.require("tokens", "there is nothing to detokenize with")
    try:
        check_token_ids(body.tokens, state.limits.vocab_size, "tokens")
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tokens") from None
    return DetokenizeResponse(prompt=await state.codec.decode(body.tokens))
