"""POST /v1/responses (OpenAI's Responses API, text and function calls): its request schema, its response object
and its stream of named events.

A request becomes a chat completion (`instructions` a system message, `input` the conversation,
`max_output_tokens` the max_tokens, `text.format` the response_format) and runs as one; only the wire
format differs. Responses are not stored (`store: true` and `previous_response_id` are refused). Function
tools are served as on chat completions; each call the model makes is a `function_call` output item. With
--reasoning-parser the model's thinking is a `reasoning` output item before the message.
"""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Discriminator, Field, Tag, WithJsonSchema

from minisgl.server.engine_client import RequestFailed
from minisgl.server.errors import ApiError, error_responses
from minisgl.server.generation import Choice, collect, outputs, start, usage
from minisgl.server.protocol import (
    SERVED_MODEL_MARK,
    JsonObjectFormat,
    StrictRequest,
    Text,
    TextFormat,
    Usage,
    integer,
    unix_now,
)
from minisgl.server.routes.chat import ChatCompletionRequest, FunctionDefinition, FunctionName
from minisgl.server.state import ServerState, server_state

router = APIRouter()


# ---------------------------------------------------------------- request


class InputText(StrictRequest):
    type: Literal["input_text"]
    text: Text


class OutputText(StrictRequest):
    """An earlier answer's text, sent back as part of the conversation."""

    type: Literal["output_text"]
    text: Text
    annotations: list[Any] = Field(default_factory=list, description="as this server returned them (none)")
    logprobs: list[Any] | None = Field(None, description="as this server returned them (none)")


class InputMessage(StrictRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[Annotated[InputText | OutputText, Field(discriminator="type")]]
    id: Text | None = Field(None, description="an earlier output item's id (sent back with it)")
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ReasoningInput(StrictRequest):
    """An earlier reasoning item sent back; chat templates leave earlier thinking out, and so does this."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


# An item without `type` is a message (OpenAI's "easy input message").
InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[ReasoningInput, Tag("reasoning")],
                      Discriminator(_item_kind)]


class JsonSchemaTextFormat(StrictRequest):
    type: Literal["json_schema"]
    name: Text
    schema_: dict[str, Any] = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = None


Format = Annotated[TextFormat | JsonObjectFormat | JsonSchemaTextFormat, Field(discriminator="type")]


class TextConfig(StrictRequest):
    format: Format = Field(default_factory=lambda: TextFormat(type="text"))


class ReasoningConfig(StrictRequest):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="none: the model does not think (the chat template's enable_thinking false); any other "
                          "effort leaves thinking on (this server has no effort levels)")


class FunctionTool(FunctionDefinition):
    """A function the model may call, in the Responses API's flat form: chat's definition beside its type."""

    type: Literal["function"]


class FunctionToolChoice(StrictRequest):
    type: Literal["function"]
    name: FunctionName


class ResponsesRequest(StrictRequest):
    model: Text = Field(json_schema_extra={SERVED_MODEL_MARK: True})
    input: Text | list[InputItem]
    instructions: Text | None = Field(None, description="a system message before the input")
    max_output_tokens: integer(ge=1) | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: TextConfig | None = Field(None, description="format: text, json_object or json_schema")
    store: Annotated[bool | None, WithJsonSchema({"enum": [False, None]})] = Field(
        None, description="responses are not stored: true is refused")
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, description="returned with the response")
    user: Text | None = None
    reasoning: ReasoningConfig | None = None
    tools: list[FunctionTool] | None = Field(None, description="function tools, served as on chat completions")
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = Field(
        None, description="as on chat completions: auto (needs --tool-call-parser), none, required or a function")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call")
    truncation: Literal["disabled"] | None = Field(None, description="disabled: an input over the context is a 400 "
                                                                     "(auto, dropping early turns, is refused)")
    # SGLang's and vLLM's sampling extensions, as on chat completions.
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    top_k: integer(ge=-1) | None = Field(None, description="-1 or 0: off")
    repetition_penalty: float | None = Field(None, gt=0)
    seed: integer(ge=-(2**63), le=2**63 - 1) | None = None

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion this request runs as."""
        if self.store:
            raise ApiError(400, "responses are not stored on this server; leave store out or set it to false",
                           param="store")
        turns = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else [
            {"role": item.role, "content": item.text()} for item in self.input if isinstance(item, InputMessage)]
        if not turns:
            raise ApiError(400, "input holds no message", param="input")
        chat = {"model": self.model, "messages": ([{"role": "system", "content": self.instructions}]
                                                  if self.instructions is not None else []) + turns,
                "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "stream": self.stream, "user": self.user, "frequency_penalty": self.frequency_penalty,
                "presence_penalty": self.presence_penalty, "top_k": self.top_k,
                "repetition_penalty": self.repetition_penalty, "seed": self.seed,
                "parallel_tool_calls": self.parallel_tool_calls,
                "tools": [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                          for tool in self.tools] if self.tools else None,
                "tool_choice": {"type": "function", "function": {"name": self.tool_choice.name}}
                if isinstance(self.tool_choice, FunctionToolChoice) else self.tool_choice if self.tools
                or self.tool_choice == "required" else None}  # without tools auto (OpenAI's default) is no call
        if self.reasoning is not None and self.reasoning.effort == "none":
            chat["chat_template_kwargs"] = {"enable_thinking": False}
        if self.text is not None and not isinstance(self.text.format, TextFormat):
            fmt = self.text.format
            chat["response_format"] = {"type": "json_object"} if isinstance(fmt, JsonObjectFormat) else {
                "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})


# ---------------------------------------------------------------- response


class OutputTextPart(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputTextPart] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: f"fc_{uuid.uuid4().hex}")
    call_id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """OpenAI's usage of a response, and SGLang's chat-style names for the same counts (its clients read them)."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int
    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        return cls(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                   total_tokens=usage.total_tokens, prompt_tokens=usage.prompt_tokens,
                   completion_tokens=usage.completion_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens))


class ResponseObject(BaseModel):
    id: str = Field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=unix_now)
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[ReasoningItem | MessageItem | FunctionCallItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = False
    parallel_tool_calls: bool = False
    tool_choice: str | dict[str, str] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    reasoning: dict[str, Any] | None = None


def finished(response: ResponseObject, finish: str | None) -> ResponseObject:
    """The response's status from its finish reason: cut by max_output_tokens is `incomplete`."""
    response.status = "incomplete" if finish == "length" else "completed"
    response.incomplete_details = {"reason": "max_output_tokens"} if finish == "length" else None
    for item in response.output:
        item.status = response.status
    return response


# ---------------------------------------------------------------- route


RESPONSES = {200: {"model": ResponseObject, "content": {"text/event-stream": {"schema": {
    "type": "object", "description": "named events (event: response.created ... response.completed)"}}}},
             **error_responses(400, 401, 404, 413, 500, 503)}


@router.post("/v1/responses", response_model=None, responses=RESPONSES)
async def responses(body: ResponsesRequest, request: Request, state: ServerState = Depends(server_state)) -> Response:
    chat = body.as_chat()
    head = ResponseObject(status="in_progress", model=state.args.served_model_name, instructions=body.instructions,
                          max_output_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
                          metadata=body.metadata or {},
                          tool_choice=body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionToolChoice)
                          else body.tool_choice or "auto",
                          tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
                          parallel_tool_calls=body.parallel_tool_calls is not False,
                          reasoning=body.reasoning.model_dump() if body.reasoning else None,
                          text={"format": body.text.format.model_dump(by_alias=True)} if body.text else
                          {"format": {"type": "text"}})
    tool_use = chat.tool_use(state.args.tool_call_parser)
    gen, choices = await start(state, chat, chat.conversation(tool_use), 1)
    [choice] = choices
    parser = chat.output_parser(tool_use, state.args.reasoning_parser, choice.prompt_text)
    if body.stream:
        return StreamingResponse(named_events(events(state, head, choice, parser, gen.prompts)),
                                 media_type="text/event-stream")
    if not await collect(request, state, choices):
        return Response(status_code=499)  # the client hung up; nobody reads this
    delta = parser.feed(choice.text) + parser.finish(choice.finish)
    message = [MessageItem(content=[OutputTextPart(text=delta.content)])] if delta.content or not delta.calls else []
    head.output = ([ReasoningItem(content=[ReasoningText(text=delta.reasoning)])] if delta.reasoning else []) + \
        message + [FunctionCallItem(name=call.name, arguments=call.arguments) for call in delta.calls]
    head.usage = ResponseUsage.of(usage(choices, gen.prompts))
    return Response(finished(head, choice.finish).model_dump_json(), media_type="application/json")


def named_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    async def frames() -> AsyncIterator[str]:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
    return frames()


async def events(state: ServerState, head: ResponseObject, choice: Choice, parser, prompts) -> AsyncIterator[dict]:
    """response.created, then each output item opened, filled by deltas and closed (a function call in one
    delta), then response.completed (or .incomplete, or .failed with the error)."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> dict:
        return {"type": kind, "sequence_number": next(numbers), **fields}

    def dump(model: BaseModel) -> dict:
        return model.model_dump(mode="json")

    yield event("response.created", response=dump(head))
    yield event("response.in_progress", response=dump(head))
    items: list[ReasoningItem | MessageItem | FunctionCallItem] = []

    def opened(kind: type) -> list[dict]:
        """Close the open item if it is of another kind and open one of `kind`; the events that says."""
        said = []
        if items and not isinstance(items[-1], kind) and items[-1].status == "in_progress":
            said += closed()
        if not items or not isinstance(items[-1], kind) or items[-1].status != "in_progress":
            item = kind(status="in_progress")
            items.append(item)
            part = ReasoningText(text="") if kind is ReasoningItem else OutputTextPart(text="")
            said.append(event("response.output_item.added", output_index=len(items) - 1, item=dump(item)))
            if kind is MessageItem:
                said.append(event("response.content_part.added", item_id=item.id, output_index=len(items) - 1,
                                  content_index=0, part=dump(part)))
            item.content.append(part)
        return said

    def closed() -> list[dict]:
        item, index = items[-1], len(items) - 1
        item.status = "completed"
        part = item.content[0]
        if isinstance(item, ReasoningItem):
            said = [event("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0,
                          text=part.text)]
        else:
            said = [event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                          text=part.text, logprobs=[]),
                    event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                          part=dump(part))]
        return said + [event("response.output_item.done", output_index=index, item=dump(item))]

    def said(reasoning: str, content: str) -> list[dict]:
        out = []
        for text, kind, name in ((reasoning, ReasoningItem, "reasoning_text"), (content, MessageItem, "output_text")):
            if text:
                out += opened(kind)
                items[-1].content[0].text += text
                out.append(event(f"response.{name}.delta", item_id=items[-1].id, output_index=len(items) - 1,
                                 content_index=0, delta=text, **({"logprobs": []} if kind is MessageItem else {})))
        return out

    def called(call) -> list[dict]:
        """A function call, whole: its item opened, its arguments in one delta, the item closed."""
        out = closed() if items and items[-1].status == "in_progress" else []
        item = FunctionCallItem(name=call.name, arguments="", status="in_progress")
        items.append(item)
        index = len(items) - 1
        out.append(event("response.output_item.added", output_index=index, item=dump(item)))
        item.arguments, item.status = call.arguments, "completed"
        return out + [event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                            delta=call.arguments),
                      event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                            arguments=call.arguments),
                      event("response.output_item.done", output_index=index, item=dump(item))]

    try:
        async for _, out in outputs(state, [choice]):
            delta = parser.feed(out.text)
            if out.finish_reason:
                delta += parser.finish(out.finish_reason)
            for e in said(delta.reasoning, delta.content) + [e for call in delta.calls for e in called(call)]:
                yield e
    except RequestFailed as failed:
        head.status, head.error = "failed", {"code": "server_error", "message": failed.message}
        yield event("response.failed", response=dump(head))
        return
    if any(isinstance(item, FunctionCallItem) for item in items):
        ending = closed() if items[-1].status == "in_progress" else []
    else:
        ending = opened(MessageItem) + closed()  # a message item, even an empty one, ends a response without calls
    for e in ending:
        yield e
    head.output, head.usage = items, ResponseUsage.of(usage([choice], prompts))
    done = finished(head, choice.finish)
    yield event("response.incomplete" if done.status == "incomplete" else "response.completed", response=dump(done))
