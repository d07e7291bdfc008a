"""POST /invocations: one route for a chat or a text completion, told apart by the body (`messages` or
`prompt`), as vLLM serves it for hosts that call a single path (Amazon SageMaker). The answer, streamed or
not, is exactly that of /v1/chat/completions or /v1/completions."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from minisgl.server.errors import ApiError
from minisgl.server.routes import chat, completions
from minisgl.server.state import ServerState, server_state

router = APIRouter()


# Out of openapi.json: its body and answers are those of the two routes (documented there), and a schema
# that is one of two large request schemas only slows schema-driven clients and fuzzers down.
@router.post("/invocations", response_model=None, include_in_schema=False)
async def invocations(request: Request, state: ServerState = Depends(server_state)) -> Response:
    try:
        payload = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(payload, dict) or ("messages" in payload) == ("prompt" in payload):
        raise ApiError(400, "the body must be a chat request (with `messages`) or a completion request (with "
                            "`prompt`), not both")
    try:
        if "messages" in payload:
            return await chat.chat_completions(chat.ChatCompletionRequest.model_validate(payload), request, state)
        return await completions.completions(completions.CompletionRequest.model_validate(payload), request, state)
    except ValidationError as exc:  # answered as the two routes answer a bad body
        raise RequestValidationError(exc.errors()) from None
