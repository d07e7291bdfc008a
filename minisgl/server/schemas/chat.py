"""The chat completions API's wire schemas: a conversation's messages, tools, the request, the answer and its
streamed chunks."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from minisgl.server.errors import ApiError
from minisgl.server.parsers.tools import ToolCall
from minisgl.server.schemas.logprobs import ChatLogprobs, PromptLogprobs
from minisgl.server.schemas.sampling import HiddenStatesOption, SamplingFields, VllmExtras
from minisgl.server.schemas.types import (
    AnswerChoice,
    Choice,
    Choices,
    FirstPromptIds,
    HiddenStates,
    LogprobCount,
    NewIds,
    NonEmptyText,
    PromptIds,
    StrictRequest,
    Text,
    TokenId,
    Usage,
    integer,
    new_id,
    omitted,
)

# ---------------------------------------------------------------- request


class ContentPart(StrictRequest):
    """One part of a message's content; only text parts are served."""

    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class CalledFunction(StrictRequest):
    name: Text
    arguments: Text = Field(description="JSON text, as the model wrote it")


class MessageToolCall(StrictRequest):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction

    def template_form(self) -> dict:
        """As chat templates take it: arguments decoded when they are a JSON object (templates apply
        `tojson` to them), else the text."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(StrictRequest):
    # OpenAI's roles, or another a model's chat template knows (Llama's `ipython`...): passed to the template as
    # vLLM passes it, which renders it or refuses the messages (a 400).
    role: Literal["system", "user", "assistant", "tool", "developer"] | NonEmptyText
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_call_id: Text | None = Field(None, description="tool messages: the call this is the result of")
    tool_calls: list[MessageToolCall] | None = Field(None, description="assistant messages: the calls made")
    reasoning_content: Text | None = Field(None, description="assistant messages: the thinking an earlier answer "
                                                             "gave (passed to the template, which may render it)")
    reasoning: Text | None = Field(None, description="vLLM's name for reasoning_content")
    # An answer's message sent back as it came (the `openai` client sends every field the response had): OpenAI's
    # output-only fields are taken when null, as the answers carry them; a value is refused (nothing renders it).
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None

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

    def template_form(self) -> dict:
        """The message as chat templates take it."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [call.template_form() for call in self.tool_calls]
        if self.reasoning_content is not None or self.reasoning is not None:
            message["reasoning_content"] = self.reasoning_content if self.reasoning is None else self.reasoning
        return message


class FunctionDefinition(StrictRequest):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(None, description="forced calls always match `parameters`; false is not weaker")


class Tool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionChoice(StrictRequest):
    name: FunctionName


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: FunctionChoice


class TemplateOptions(StrictRequest):
    """How the conversation is put through the chat template (vLLM's and SGLang's extensions; chat and
    /tokenize)."""

    add_generation_prompt: bool | None = Field(
        None, description="open the assistant's turn after the messages; left out: true, unless "
                          "continue_final_message")
    continue_final_message: bool = Field(
        False, description="leave the last message open (no end-of-turn) so that the model goes on with it "
                           "(prefill an assistant answer)")

    def template_options(self) -> dict[str, bool]:
        """The Conversation's options; both set true is a 400, as in vLLM (they contradict each other)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "Cannot set both continue_final_message and add_generation_prompt to true: one opens "
                                "a new assistant turn, the other continues the last message",
                           param="continue_final_message")
        add = self.add_generation_prompt if self.add_generation_prompt is not None else not self.continue_final_message
        return {"add_generation_prompt": add, "continue_final_message": self.continue_final_message}


# The schema says what `prompt` checks: messages, or (vLLM's token-in) prompt_token_ids and no messages.
MESSAGES_OR_TOKEN_IDS = {
    "if": {"required": ["prompt_token_ids"], "properties": {"prompt_token_ids": {"type": "array"}}},
    "then": {"properties": {"messages": {"maxItems": 0}}}, "else": {"properties": {"messages": {"minItems": 1}}}}


class ChatCompletionRequest(SamplingFields, TemplateOptions, VllmExtras, HiddenStatesOption):
    model_config = ConfigDict(json_schema_extra=MESSAGES_OR_TOKEN_IDS)

    messages: list[ChatMessage] = Field(description="the conversation; empty only with prompt_token_ids")
    prompt_token_ids: list[TokenId] | None = Field(
        None, min_length=1, description="vLLM's: the prompt as token ids, already templated (messages empty); "
                                        "the chat template's options are refused with it")
    max_tokens: integer(ge=1) | None = None
    max_completion_tokens: integer(ge=1) | None = Field(None, description="wins over max_tokens")
    logprobs: bool = False
    top_logprobs: LogprobCount | None = Field(None, description="needs logprobs: true")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools (needs the server's --tool-call-parser), else none")
    parallel_tool_calls: bool = Field(True, description="false: at most one call per choice")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template, e.g. {\"enable_thinking\": false}")
    echo: bool = Field(False, description="vLLM's: a last assistant message (a prefill the model continues) is "
                                          "put before the answer's content")
    separate_reasoning: bool = Field(True, description="SGLang's and vLLM's: false leaves the thinking in the "
                                                       "content as the model wrote it (--reasoning-parser not run)")
    include_reasoning: bool = Field(True, description="vLLM's: false drops the thinking from the answer")
    stream_reasoning: bool = Field(True, description="SGLang's: false sends a streamed choice's thinking in one "
                                                     "delta, once it is complete")
    add_special_tokens: bool = Field(False, description="vLLM's: true adds the tokenizer's special tokens (a BOS) "
                                     "to what the chat template wrote (which has its own)")


ConversationMessages = Annotated[list[ChatMessage], Field(min_length=1)]


class BatchChatCompletionRequest(ChatCompletionRequest):
    model_config = ConfigDict(json_schema_extra=None)

    messages: list[ConversationMessages] = Field(min_length=1, description="one conversation per item")  # type: ignore
    stream: Literal[False] = Field(False, description="not served: the answer comes whole")  # type: ignore
    prompt_token_ids: None = None  # type: ignore
    prompt_logprobs: None = None  # type: ignore



# ---------------------------------------------------------------- response


class ResponseFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: ResponseFunction

    @classmethod
    def of(cls, call: ToolCall) -> ResponseToolCall:
        return cls(function=ResponseFunction(name=call.name, arguments=call.arguments))


class ChatResponseMessage(BaseModel):
    """OpenAI's message fields, each present (null when empty), as OpenAI's and vLLM's answers have them: a
    client comparing an answer's keys with its own model of the message finds them all."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = Field(None, description="the model's thinking (with --reasoning-parser); null "
                                                            "when none, as SGLang answers (its clients read it)")
    reasoning: str | None = Field(None, exclude_if=omitted, description="vLLM's name for reasoning_content")


class ChatChoice(AnswerChoice[ChatLogprobs]):
    message: ChatResponseMessage


class ChatCompletionResponse(Choices[ChatChoice]):
    id: str = new_id("chatcmpl")
    object: Literal["chat.completion"] = "chat.completion"
    usage: Usage
    # OpenAI's optional fields this server has nothing for: null, as vLLM answers (see ChatResponseMessage).
    service_tier: None = None
    system_fingerprint: None = None
    metadata: None = None
    moderation: None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's prompt_logprobs (when asked for)")
    prompt_token_ids: PromptIds = None


class DeltaToolCall(ResponseToolCall):
    """A whole call in one delta (its arguments are not split across chunks)."""

    index: int


class DeltaMessage(BaseModel):
    """A delta carries only what changed: the first chunk the role, later ones the new text or calls (and
    `reasoning_content`, null when there is none)."""

    role: Literal["assistant"] | None = Field(None, exclude_if=omitted)
    content: str | None = Field(None, exclude_if=omitted)
    reasoning_content: str | None = Field(None, description="null when none, as SGLang's deltas have it")
    reasoning: str | None = Field(None, exclude_if=omitted, description="vLLM's name for reasoning_content")
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=omitted)
    hidden_states: HiddenStates = None


class ChatChunkChoice(Choice[ChatLogprobs]):
    delta: DeltaMessage
    token_ids: NewIds = None


class ChatCompletionChunk(Choices[ChatChunkChoice]):
    id: str = new_id("chatcmpl")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=omitted, description="with a choice's first tokens")
    prompt_token_ids: FirstPromptIds = None
