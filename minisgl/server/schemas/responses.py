"""The Responses API's wire schemas: input items, the request, output items and the response object."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from minisgl.server.schemas.chat import FunctionDefinition, FunctionName
from minisgl.server.schemas.logprobs import TokenLogprob
from minisgl.server.schemas.sampling import CommonSampling, JsonObjectFormat, TextFormat
from minisgl.server.schemas.types import LogprobCount, StrictRequest, Text, Usage, integer, unix_now

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


OUTPUT_LOGPROBS = "message.output_text.logprobs"
Includable = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                     "web_search_call.results", "web_search_call.action.sources", "code_interpreter_call.outputs",
                     "computer_call_output.output.image_url", "message.input_image.image_url"]


class ResponsesRequest(CommonSampling):
    """The create body: the common sampling fields (SGLang's and vLLM's extensions among them, as on chat),
    and the Responses API's own."""

    input: Text | list[InputItem]
    instructions: Text | None = Field(None, description="a system message before the input")
    max_output_tokens: integer(ge=1) | None = None
    text: TextConfig | None = Field(None, description="format: text, json_object or json_schema")
    include: list[Includable] | None = Field(
        None, description="message.output_text.logprobs is served (with top_logprobs alternatives); the others "
                          "name outputs this server never makes (its tools' results, encrypted reasoning, images): "
                          "taken, with nothing to add, as vLLM takes them")
    top_logprobs: LogprobCount | None = Field(None, description="alternatives per token; needs include "
                                                                "message.output_text.logprobs")
    store: bool | None = Field(None, description="false: not kept for GET /v1/responses/{id} (default: kept)")
    background: bool | None = Field(None, description="answer at once (queued) and generate behind; needs store")
    previous_response_id: Text | None = Field(None, description="a stored response this one continues")
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, description="returned with the response")
    reasoning: ReasoningConfig | None = None
    tools: list[FunctionTool] | None = Field(None, description="function tools, served as on chat completions")
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = Field(
        None, description="as on chat completions: auto (needs --tool-call-parser), none, required or a function")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call")
    truncation: Literal["disabled"] | None = Field(None, description="disabled: an input over the context is a 400 "
                                                                     "(auto, dropping early turns, is refused)")

    @property
    def stored(self) -> bool:
        return self.store is not False

    def listed_input(self) -> list[dict]:
        """This request's input items as `input_items` lists them."""
        return [listed(item) for item in ([self.input] if isinstance(self.input, str) else self.input)]

    def turns(self) -> list[dict]:
        """This request's input as chat messages."""
        return [{"role": "user", "content": self.input}] if isinstance(self.input, str) else as_messages(self.input)


# ---------------------------------------------------------------- response


class OutputTextPart(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list, description="with include "
                                         "message.output_text.logprobs: the output tokens' logprobs")


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


class Deleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
