"""POST /tokenize, POST /detokenize (vLLM's and SGLang's extensions) and GET /tokenizer_info (vLLM's).

Both run off the event loop, like generation's tokenization. /tokenize returns at most a context's worth
of ids (a longer text is answered 400 with its token count: millions of ids would only stall the
server); /detokenize checks its ids against the vocabulary. /tokenizer_info describes the tokenizer (its
configuration, special tokens and chat template): with it, clients such as lm-evaluation-harness tokenize
through this server instead of loading the tokenizer themselves."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from minisgl.core import check_token_ids
from minisgl.server.errors import ApiError, error_responses
from minisgl.server.protocol import SERVED_MODEL_MARK, StrictRequest, Text, TokenId
from minisgl.server.routes.chat import ChatMessage, TemplateOptions, Tool
from minisgl.server.state import ServerState, server_state
from minisgl.server.text import Conversation

router = APIRouter()


class ModelOption(StrictRequest):
    """vLLM's optional `model` of /tokenize and /detokenize."""

    model: Text = Field(None, json_schema_extra={SERVED_MODEL_MARK: True},
                        description="optional (null refused); when given, the served model (else 404)")


class TokenizeOptions(ModelOption):
    """vLLM's options of both shapes."""

    return_token_strs: bool = Field(False, description="also each token as the tokenizer spells it")


class TokenizeText(TokenizeOptions):
    prompt: Text
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (a BOS), as "
                                     "/v1/completions does by default (vLLM's and SGLang's default)")


class TokenizeChat(TemplateOptions, TokenizeOptions):
    """A conversation: its token ids after the chat template, as /v1/chat/completions would see them."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, description="shown to the model by the chat template, as on chat")
    add_special_tokens: bool = Field(False, description="add the tokenizer's special tokens (a BOS) to what the "
                                     "chat template wrote, as chat's field of the same name (vLLM's default)")

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
    token_strs: list[str] | None = Field(None, description="with return_token_strs (else null, as vLLM has it)")


class DetokenizeRequest(ModelOption):
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 401, 404, 413, 503))
async def tokenize(body: TokenizeRequest, state: ServerState = Depends(server_state)) -> TokenizeResponse:
    state.check_serving()
    state.check_model(body.model)
    param = "prompt" if isinstance(body, TokenizeText) else "messages"
    state.codec.require(param, "there is nothing to tokenize with")
    limits = state.limits
    special = body.add_special_tokens
    if isinstance(body, TokenizeText):
        count, ids = await state.codec.encode(body.prompt, limits.max_seq_len, special)
    else:
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        conversation = Conversation([m.template_form() for m in body.messages], tools, **body.template_options())
        count, ids, _ = await state.codec.encode_chat(conversation, limits.max_seq_len, special)
    if count > limits.max_seq_len:
        raise ApiError(400, f"the text has {count} tokens, more than this model's context of {limits.max_seq_len}",
                       param=param, code="context_length_exceeded")
    strs = state.codec.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(tokens=ids, count=count, max_model_len=limits.max_seq_len, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse,
             responses=error_responses(400, 401, 404, 413, 503))
async def detokenize(body: DetokenizeRequest, state: ServerState = Depends(server_state)) -> DetokenizeResponse:
    state.check_serving()
    state.check_model(body.model)
    state.codec.require("tokens", "there is nothing to detokenize with")
    try:
        check_token_ids(body.tokens, state.limits.vocab_size, "tokens")
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tokens") from None
    return DetokenizeResponse(prompt=await state.codec.decode(body.tokens))


def plain_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


@router.get("/tokenizer_info", responses=error_responses(400, 401, 503))
async def tokenizer_info(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """The tokenizer's configuration (what tokenizer_config.json holds, JSON values only), its class, chat
    template and added tokens, as vLLM's endpoint gives them (served always; vLLM's flag is accepted)."""
    state.codec.require(None, "there is no tokenizer to describe")
    tok = state.codec.tokenizer
    config = {key: value for key, value in tok.init_kwargs.items() if plain_json(value)}
    added = {str(token_id): {"content": token.content, "special": token.special}
             for token_id, token in tok.added_tokens_decoder.items()}
    special = {name: getattr(tok, name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return config | {name: text for name, text in special.items() if text is not None} | {
        "tokenizer_class": type(tok).__name__, "chat_template": tok.chat_template,
        "model_max_length": tok.model_max_length, "added_tokens_decoder": added}
