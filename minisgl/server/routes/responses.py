"""OpenAI's Responses API (text and function calls): `POST /v1/responses` with its request schema, its response
object and its stream of named events; the stored responses' routes (`GET`/`DELETE /v1/responses/{id}`,
`POST .../cancel`, `GET .../input_items`).

A request becomes a chat completion (`instructions` a system message, `input` the conversation after the
stored one `previous_response_id` names, `max_output_tokens` the max_tokens, `text.format` the
response_format) and runs as one; only the wire format differs. Function tools are served as on chat
completions; each call the model makes is a `function_call` output item, and `function_call` /
`function_call_output` input items are the calls and results sent back. With --reasoning-parser the model's
thinking is a `reasoning` output item before the message. Responses are stored (responses_store.py) unless
`store: false`; `background: true` answers at once (`queued`) and generates behind.
"""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from typing import Annotated, Any, AsyncIterator, Callable, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Discriminator, Field, Tag
from starlette.requests import HTTPConnection

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
from minisgl.server.responses_store import ResponseStore, Stored
from minisgl.server.routes.chat import ChatCompletionRequest, FunctionDefinition, FunctionName
from minisgl.server.state import ServerState, server_state

router = APIRouter()
logger = logging.getLogger("minisgl.api")


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
    encrypted_content: None = Field(None, description="as this server returned it (none)")
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallInput(StrictRequest):
    """A call an earlier answer made, sent back: consecutive ones are one assistant turn's calls."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    namespace: None = Field(None, description="as this server returned it (none: namespace tools are not served)")
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputInput(StrictRequest):
    """A call's result, for the model to read (a `tool` turn)."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputText]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


def _item_kind(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


# An item without `type` is a message (OpenAI's "easy input message").
InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[ReasoningInput, Tag("reasoning")]
                      | Annotated[FunctionCallInput, Tag("function_call")]
                      | Annotated[FunctionCallOutputInput, Tag("function_call_output")], Discriminator(_item_kind)]


def as_messages(items: list) -> list[dict]:
    """Input or output items as the chat messages they stand for: a message its role's turn, consecutive
    function calls one assistant turn with those calls, a call's output a tool turn; reasoning is left out."""
    messages: list[dict] = []
    calls_open = False  # the last message is an assistant turn made of function calls only
    for item in items:
        if item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if calls_open:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        elif item.type == "message":
            messages.append({"role": item.role, "content": item.text()})
        calls_open = item.type == "function_call"
    return messages


def listed(item: BaseModel | str) -> dict:
    """An input item as `GET /v1/responses/{id}/input_items` lists it: with an id, a message's text as parts."""
    if isinstance(item, str):
        item = InputMessage(role="user", content=item)
    listing = item.model_dump(mode="json", exclude_none=True)
    listing.setdefault("type", "message")
    listing["id"] = item.id or f"{ITEM_PREFIX[listing['type']]}_{uuid.uuid4().hex}"
    if isinstance(item, InputMessage) and isinstance(item.content, str):
        kind = "output_text" if item.role == "assistant" else "input_text"
        listing["content"] = [{"type": kind, "text": item.content}]
    return listing


ITEM_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc", "function_call_output": "fco"}


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
    # Optional, as vLLM has it (OpenAI requires it): left out, the served model; null is refused.
    model: Text = Field(None, json_schema_extra={SERVED_MODEL_MARK: True})
    input: Text | list[InputItem]
    instructions: Text | None = Field(None, description="a system message before the input")
    max_output_tokens: integer(ge=1) | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: TextConfig | None = Field(None, description="format: text, json_object or json_schema")
    store: bool | None = Field(None, description="false: not kept for GET /v1/responses/{id} (default: kept)")
    background: bool | None = Field(None, description="answer at once (queued) and generate behind; needs store")
    previous_response_id: Text | None = Field(None, description="a stored response this one continues")
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

    @property
    def stored(self) -> bool:
        return self.store is not False

    def listed_input(self) -> list[dict]:
        """This request's input items as `input_items` lists them."""
        return [listed(item) for item in ([self.input] if isinstance(self.input, str) else self.input)]

    def turns(self) -> list[dict]:
        """This request's input as chat messages."""
        return [{"role": "user", "content": self.input}] if isinstance(self.input, str) else as_messages(self.input)

    def as_chat(self, history: list[dict]) -> ChatCompletionRequest:
        """The chat completion this request runs as, after `history` (the conversation it continues)."""
        if self.background and not self.stored:
            raise ApiError(400, "background can only be used when `store` is true", param="background")
        if self.background and self.stream:
            raise ApiError(400, "background responses are not streamed here; poll GET /v1/responses/{id}",
                           param="background")
        turns = history + self.turns()
        if not any(turn["role"] != "assistant" for turn in turns):
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

    def text(self) -> str:
        return "".join(part.text for part in self.content)


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
    status: Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]
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
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
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


def response_store(conn: HTTPConnection) -> ResponseStore:
    """FastAPI dependency: the app's store of responses (api.py makes it)."""
    return conn.app.state.responses


class Run:
    """A started response: its object (filled in as it runs), its one generated sequence, the parser of its
    text, and the conversation it continues (what storing it needs)."""

    def __init__(self, body: ResponsesRequest, head: ResponseObject, choice: Choice, parser, prompts: list[list[int]],
                 history: list[dict]):
        self.body, self.head, self.choice, self.parser, self.prompts = body, head, choice, parser, prompts
        self.history = history

    def whole(self) -> ResponseObject:
        """The response once its sequence has run to its end: its output items, usage and status."""
        delta = self.parser.feed(self.choice.text) + self.parser.finish(self.choice.finish)
        message = [MessageItem(content=[OutputTextPart(text=delta.content)])] if delta.content or not delta.calls \
            else []
        self.head.output = ([ReasoningItem(content=[ReasoningText(text=delta.reasoning)])] if delta.reasoning
                            else []) + message + [FunctionCallItem(name=call.name, arguments=call.arguments)
                                                  for call in delta.calls]
        self.head.usage = ResponseUsage.of(usage([self.choice], self.prompts))
        return finished(self.head, self.choice.finish)

    def entry(self) -> Stored:
        """What the store keeps of this response."""
        return Stored(self.head, self.history + self.body.turns() + as_messages(self.head.output),
                      self.body.listed_input())


def head_of(body: ResponsesRequest, model: str) -> ResponseObject:
    """The response object before any output: the request's settings, as the response echoes them."""
    return ResponseObject(status="in_progress", model=model, instructions=body.instructions,
                          max_output_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
                          metadata=body.metadata or {}, store=body.stored, background=bool(body.background),
                          previous_response_id=body.previous_response_id,
                          tool_choice=body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionToolChoice)
                          else body.tool_choice or "auto",
                          tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
                          parallel_tool_calls=body.parallel_tool_calls is not False,
                          reasoning=body.reasoning.model_dump() if body.reasoning else None,
                          text={"format": body.text.format.model_dump(by_alias=True)} if body.text else
                          {"format": {"type": "text"}})


async def begin(state: ServerState, body: ResponsesRequest, history: list[dict]) -> Run:
    """Check the request and submit its generation, after `history` (the conversation it continues)."""
    chat = body.as_chat(history)
    tool_use = chat.tool_use(state.args.tool_call_parser)
    gen, [choice] = await start(state, chat, chat.conversation(tool_use), 1)
    parser = chat.output_parser(tool_use, state.args.reasoning_parser, choice.prompt_text)
    return Run(body, head_of(body, state.args.served_model_name), choice, parser, gen.prompts, history)


@router.post("/v1/responses", response_model=None, responses=RESPONSES)
async def responses(body: ResponsesRequest, request: Request, state: ServerState = Depends(server_state),
                    store: ResponseStore = Depends(response_store)) -> Response:
    history = store.previous(body.previous_response_id).messages if body.previous_response_id else []
    run = await begin(state, body, history)
    keep = store.put if body.stored else None
    if body.background:
        run.head.status = "queued"
        answer = run.head.model_dump_json()
        store.run_behind(run.entry(), behind(state, run, store))
        return Response(answer, media_type="application/json")
    if body.stream:
        return StreamingResponse(named_events(events(state, run, keep)), media_type="text/event-stream")
    if not await collect(request, state, [run.choice]):
        return Response(status_code=499)  # the client hung up; nobody reads this
    head = run.whole()
    if keep:
        keep(run.entry())
    return Response(head.model_dump_json(), media_type="application/json")


async def behind(state: ServerState, run: Run, store: ResponseStore) -> None:
    """A background response's generation: in progress, then stored with its output (or its error).
    Cancelled (POST .../cancel, DELETE), it stops where it is; leaving `outputs` aborts the sequence."""
    run.head.status = "in_progress"
    try:
        async for _ in outputs(state, [run.choice]):
            pass
    except RequestFailed as failed:
        run.head.status, run.head.error = "failed", {"code": "server_error", "message": failed.message}
    except Exception as exc:  # a bug: the response must still end (failed), not stay in progress
        logger.exception("background response %s failed", run.head.id)
        run.head.status, run.head.error = "failed", {"code": "server_error",
                                                     "message": f"internal error: {type(exc).__name__}"}
    else:
        run.whole()
    store.put(run.entry())


STORED = error_responses(400, 401, 404)


class Deleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# GET and DELETE are one route: a 405 then lists both in `Allow` (Starlette answers 405 from the first route
# whose path matches).
@router.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], response_model=None, responses={
    200: {"content": {"application/json": {"schema": {"anyOf": [
        {"$ref": "#/components/schemas/ResponseObject"}, {"$ref": "#/components/schemas/Deleted"}]}}},
          "description": "GET: the stored response; DELETE: that it is forgotten"}, **STORED})
async def stored_response(response_id: str, request: Request,
                          store: ResponseStore = Depends(response_store)) -> Response:
    """GET: a stored response. DELETE: forget it (a background one still running is stopped first)."""
    if request.method == "DELETE":
        await store.delete(response_id)
        return Response(Deleted(id=response_id).model_dump_json(), media_type="application/json")
    return Response(store.get(response_id).response.model_dump_json(), media_type="application/json")


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject, responses=STORED)
async def cancel_response(response_id: str, store: ResponseStore = Depends(response_store)) -> Response:
    """Stop a background response: its generation is aborted (its KV pages freed) before this answers."""
    entry = await store.cancel(response_id)
    return Response(entry.response.model_dump_json(), media_type="application/json")


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


@router.get("/v1/responses/{response_id}/input_items", response_model=InputItemList, responses=STORED)
async def input_items(response_id: str, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                      order: Literal["asc", "desc"] = "desc", after: str | None = None,
                      store: ResponseStore = Depends(response_store)) -> InputItemList:
    """The input items of a stored response (its own input, not the conversation before it), a page at a time."""
    items = store.get(response_id).input_items
    items = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, f"no input item {after[:200]!r} in response {response_id[:200]!r}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)


def named_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    async def frames() -> AsyncIterator[str]:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
    return frames()


async def events(state: ServerState, run: Run, keep: Callable[[Stored], None] | None) -> AsyncIterator[dict]:
    """response.created, then each output item opened, filled by deltas and closed (a function call in one
    delta), then response.completed (or .incomplete, or .failed with the error); `keep` is handed the
    finished response before that last event is sent."""
    head, choice, parser = run.head, run.choice, run.parser
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
        if keep:
            keep(run.entry())
        yield event("response.failed", response=dump(head))
        return
    if any(isinstance(item, FunctionCallItem) for item in items):
        ending = closed() if items[-1].status == "in_progress" else []
    else:
        ending = opened(MessageItem) + closed()  # a message item, even an empty one, ends a response without calls
    for e in ending:
        yield e
    head.output, head.usage = items, ResponseUsage.of(usage([choice], run.prompts))
    done = finished(head, choice.finish)
    if keep:
        keep(run.entry())
    yield event("response.incomplete" if done.status == "incomplete" else "response.completed", response=dump(done))
