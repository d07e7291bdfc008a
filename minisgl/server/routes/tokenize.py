"""POST /tokenize, POST /detokenize (vLLM's and SGLang's extensions) and GET /tokenizer_info (vLLM's).

Both run off the event loop, like generation's tokenization. /tokenize returns at most a context's worth
of ids (a longer text is answered 400 with its token count: millions of ids would only stall the
server); /detokenize checks its ids against the vocabulary. /tokenizer_info describes the tokenizer (its
configuration, special tokens and chat template): with it, clients such as lm-evaluation-harness tokenize
through this server instead of loading the tokenizer themselves."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends

from minisgl.core import check_token_ids
from minisgl.server.errors import ApiError, error_responses
from minisgl.server.schemas.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizeText,
)
from minisgl.server.state import ServerState, server_state
from minisgl.server.text import Conversation

router = APIRouter()



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
