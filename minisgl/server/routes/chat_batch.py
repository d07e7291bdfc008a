"""POST /v1/chat/completions/batch (vLLM's): several conversations in one request, each answered as
/v1/chat/completions would answer it alone, in one response whose choice `index` is the conversation's
(times n, plus the sample). Not streamed; vLLM's per-prompt fields (prompt_token_ids, prompt_logprobs) have
no single prompt to describe here, and are refused by the schema.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field

from minisgl.server.errors import error_responses
from minisgl.server.generation import Choice, respond
from minisgl.server.parsers.output import OutputParser
from minisgl.server.protocol import Usage
from minisgl.server.routes.chat import ChatCompletionRequest, ChatCompletionResponse, ChatMessage, chat_choices
from minisgl.server.state import ServerState, server_state

router = APIRouter()

Conversation = Annotated[list[ChatMessage], Field(min_length=1)]


class BatchChatCompletionRequest(ChatCompletionRequest):
    model_config = ConfigDict(json_schema_extra=None)

    messages: list[Conversation] = Field(min_length=1, description="one conversation per item")  # type: ignore
    stream: Literal[False] = Field(False, description="not served: the answer comes whole")  # type: ignore
    prompt_token_ids: None = None  # type: ignore
    prompt_logprobs: None = None  # type: ignore

    def conversation_at(self, index: int) -> ChatCompletionRequest:
        """The single-conversation request that conversation `index` stands for."""
        return ChatCompletionRequest.model_construct(**{**dict(self), "messages": self.messages[index]})


# Not in openapi.json: its body is chat's with `messages` a list of conversations (docs/compatibility.md). Listed,
# the schema fuzzer's conversations overflow a short test context in most batches (each must fit), which it reads
# as a schema that promises more than the route accepts.
@router.post("/v1/chat/completions/batch", response_model=ChatCompletionResponse, include_in_schema=False,
             responses=error_responses(400, 401, 404, 413, 500, 503))
async def batch_chat_completions(body: BatchChatCompletionRequest, request: Request,
                                 state: ServerState = Depends(server_state)) -> Response:
    singles = [body.conversation_at(i) for i in range(len(body.messages))]
    tool_use = body.tool_use(state.args.tool_call_parser)

    def parser(c: Choice) -> OutputParser:
        return body.output_parser(tool_use, state.args.reasoning_parser, c.prompt_text)

    def whole(choices: list[Choice], usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(model=state.args.served_model_name, usage=usage, choices=chat_choices(
            body, choices, parser, lambda c: singles[c.prompt].echoed()))

    return await respond(request, state, body, [single.conversation(tool_use) for single in singles], len(singles),
                         whole, stream=None)
