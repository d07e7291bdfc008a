"""POST /v1/chat/completions: its request schema, its route, its response and its stream of chunks.

Tools: the chat template renders `tools`; with tool_choice `auto` the server's --tool-call-parser finds
the calls the model writes, `required` and a named function force them through a grammar (see
parsers/tools.py). A choice that ends in calls has `finish_reason: "tool_calls"`. With --reasoning-parser
the model's `<think>` block becomes `reasoning_content` (and vLLM's `reasoning`: parsers/reasoning.py).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, AsyncIterator, Callable, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from minisgl.core import Constraint
from minisgl.server.boundary import GenerateRequest
from minisgl.server.errors import ApiError
from minisgl.server.generation import Choice, generation_responses, outputs, respond, usage, usage_so_far
from minisgl.server.parsers.output import ChoiceDelta, OutputParser, ToolUse
from minisgl.server.parsers.reasoning import ReasoningParser
from minisgl.server.parsers.tools import ToolCall, forced_schema
from minisgl.server.protocol import (
    ChatLogprobs,
    Envelope,
    HiddenStatesOption,
    LogprobCount,
    NonEmptyText,
    PromptLogprobs,
    SamplingFields,
    StrictRequest,
    Text,
    TokenId,
    Usage,
    VllmExtras,
    chat_logprobs,
    integer,
    new_id,
    omitted,
    vllm_prompt_logprobs,
)
from minisgl.server.state import ServerState, server_state
from minisgl.server.text import Conversation

router = APIRouter()


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


THINKING_HINT = "Think step by step and use fewer than {} reasoning tokens before the final answer."


def with_thinking_hint(messages: list[dict], budget: int) -> list[dict]:
    """vLLM's prompt for a thinking budget: its hint ends a leading system message, or is one of its own first,
    so that the model plans for the budget the engine enforces."""
    hint = THINKING_HINT.format(budget)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{hint}"}, *messages[1:]]
    return [{"role": "system", "content": hint}, *messages]


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

    def shown(self, delta: ChoiceDelta) -> ChoiceDelta:
        """What the answer shows of a parsed delta: its reasoning dropped when include_reasoning is false."""
        if not self.include_reasoning:
            delta.reasoning = ""
        return delta

    def echoed(self) -> str:
        """What `echo` puts before each choice's content: the last message's text when it is the assistant's."""
        last = self.messages[-1] if self.messages else None
        return last.text() if self.echo and last is not None and last.role == "assistant" else ""

    def prompt(self, tool_use: ToolUse | None) -> Conversation | list[list[int]]:
        """The conversation to put through the chat template or, as vLLM takes them, token ids already
        templated: then the template's options would do nothing, and are refused."""
        if self.prompt_token_ids is None:
            if not self.messages:
                raise ApiError(400, "messages must not be empty (or send prompt_token_ids)", param="messages")
            return self.conversation(tool_use)
        if self.messages:
            raise ApiError(400, "send messages or prompt_token_ids, not both", param="prompt_token_ids")
        template_options = {"add_generation_prompt": self.add_generation_prompt is not None,
                            "continue_final_message": self.continue_final_message, "echo": self.echo,
                            "chat_template_kwargs": self.chat_template_kwargs is not None}
        for name, given in template_options.items():
            if given:
                raise ApiError(400, f"{name} applies to messages put through the chat template; prompt_token_ids "
                                    f"are already templated", param=name)
        return [self.prompt_token_ids]

    def sampling(self) -> tuple[dict[str, Any], dict[str, str]]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        by_completion = self.max_completion_tokens is not None
        values = self.shared_sampling() | {
            "max_tokens": self.max_completion_tokens if by_completion else self.max_tokens,
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "return_hidden_states": self.return_hidden_states} | self.prompt_scoring(self.prompt_logprobs)
        renamed = {"logprobs": "top_logprobs"} | ({"max_tokens": "max_completion_tokens"} if by_completion else {})
        return values, renamed

    def tool_mode(self) -> tuple[Literal["auto", "named", "required"], str | None] | None:
        """(mode, function name) when the output may hold tool calls; None when it may not."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise ApiError(400, "tool_choice needs tools", param="tool_choice")
            return None
        names = [tool.function.name for tool in self.tools]
        if len(set(names)) < len(names):
            raise ApiError(400, "tools must have distinct function names", param="tools")
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ApiError(400, f"Tool {choice.function.name!r} not found in tools list (tool_choice names it)",
                               param="tool_choice")
            return "named", choice.function.name
        return ("required" if choice == "required" else "auto"), None

    def tool_use(self, parser: str | None) -> ToolUse | None:
        mode = self.tool_mode()
        if mode is None:
            return None
        if mode[0] == "auto" and parser is None:
            raise ApiError(400, "this server runs without --tool-call-parser, so it cannot find the calls a model "
                                "chooses to make; send tool_choice 'required', a named function or 'none'",
                           param="tool_choice" if self.tool_choice else "tools")
        return ToolUse(mode[0], mode[1], parser, self.parallel_tool_calls)

    def constraints(self) -> list[tuple[str, Constraint]]:
        asked = super().constraints() + self.vllm_constraints()
        mode = self.tool_mode()
        if mode is not None and mode[0] != "auto":
            functions = {t.function.name: t.function.parameters or {"type": "object"} for t in self.tools}
            schema = forced_schema(functions, mode[1], self.parallel_tool_calls)
            asked.append(("tool_choice", Constraint("json_schema", json.dumps(schema))))
        return asked

    def conversation(self, tool_use: ToolUse | None) -> Conversation:
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None
        messages = [m.template_form() for m in self.messages]
        if self.thinking_token_budget not in (None, -1):
            messages = with_thinking_hint(messages, self.thinking_token_budget)
        return Conversation(messages, tools, tools_needed=tool_use is not None,
                            template_kwargs=self.chat_template_kwargs or {}, **self.template_options())

    def output_parser(self, tool_use: ToolUse | None, reasoning: str | None, prompt_text: str | None) -> OutputParser:
        """A choice's parser. Under a grammar the output is what the grammar says from its first token on,
        even if the prompt opened a reasoning block (a grammar may still write one: it is split off)."""
        opened = "" if self.constraints() else prompt_text or ""
        split = reasoning is not None and self.separate_reasoning
        return OutputParser(tool_use, ReasoningParser(reasoning, opened) if split else None)


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


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, description="the output's ids (return_token_ids; else null, as vLLM "
                                                         "has it)")
    matched_stop: str | int | None = Field(None, description="SGLang's: the stop string or stop/EOS token id that "
                                                             "ended a 'stop' choice")
    hidden_states: list[float] | None = Field(None, exclude_if=omitted, description="SGLang's return_hidden_states")


class ChatCompletionResponse(Envelope):
    id: str = new_id("chatcmpl")
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    # OpenAI's optional fields this server has nothing for: null, as vLLM answers (see ChatResponseMessage).
    service_tier: None = None
    system_fingerprint: None = None
    metadata: None = None
    moderation: None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's prompt_logprobs (when asked for)")
    prompt_token_ids: list[int] | None = Field(None, description="the prompt's ids (return_token_ids; else null)")


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
    hidden_states: list[float] | None = Field(None, exclude_if=omitted, description="SGLang's: in a chunk of its own "
                                              "after the choice's last")


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=omitted, description="the new ids (return_token_ids)")


class ChatCompletionChunk(Envelope):
    id: str = new_id("chatcmpl")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=omitted, description="with a choice's first tokens")
    prompt_token_ids: list[int] | None = Field(None, exclude_if=omitted, description="with the first chunk")


# ---------------------------------------------------------------- route


@router.post("/v1/chat/completions", response_model=None,
             responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk))
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           state: ServerState = Depends(server_state)) -> Response:
    tool_use = body.tool_use(state.args.tool_call_parser)
    model = state.args.served_model_name

    def parser(c: Choice) -> OutputParser:
        return body.output_parser(tool_use, state.args.reasoning_parser, c.prompt_text)

    def whole(choices: list[Choice], usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(model=model, usage=usage, choices=chat_choices(body, choices, parser,
                                                                                    lambda _: body.echoed()),
                                      **prompt_extras(body, choices[0]))

    return await respond(request, state, body, body.prompt(tool_use), 1, whole,
                         lambda gen, choices: chunks(state, body, gen, choices, model, parser))


def chat_choices(body: ChatCompletionRequest, choices: list[Choice], parser: Callable[[Choice], OutputParser],
                 echoed: Callable[[Choice], str]) -> list[ChatChoice]:
    """Each finished choice as the answer shows it: its output parsed (reasoning, tool calls), `echoed` text
    first."""
    answers = []
    for c in choices:
        parsed = parser(c)
        delta = body.shown(parsed.feed(c.text) + parsed.finish(c.finish))
        content = echoed(c) + delta.content
        message = ChatResponseMessage(
            content=None if delta.calls and not content.strip() else content,
            reasoning_content=delta.reasoning or None, reasoning=delta.reasoning or None,
            tool_calls=[ResponseToolCall.of(call) for call in delta.calls] or None)
        logprobs = chat_logprobs(c.logprobs, body.return_tokens_as_token_ids) if c.logprobs else None
        answers.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason(c.finish, parsed),
                                  logprobs=logprobs, token_ids=c.token_ids if body.return_token_ids else None,
                                  matched_stop=c.matched_stop,
                                  hidden_states=c.hidden_states if body.return_hidden_states else None))
    return answers


def prompt_extras(body: ChatCompletionRequest, choice: Choice) -> dict:
    """vLLM's prompt_logprobs (null unless asked for) and, with return_token_ids, the prompt's ids."""
    return {"prompt_logprobs": vllm_prompt_logprobs(choice.prompt_logprobs or [])
            if body.prompt_logprobs is not None else None,
            "prompt_token_ids": choice.prompt_ids if body.return_token_ids else None}


def content_or_nothing(delta: ChoiceDelta, calls: list | None) -> str | None:
    """A delta with neither text, reasoning nor calls (a token still held back, the last chunk) has content
    "", as OpenAI's and SGLang's do: clients read delta.content as a string on every chunk after the first."""
    return None if delta.reasoning or calls else ""


def finish_reason(finish: str | None, parser: OutputParser) -> str | None:
    return "tool_calls" if finish == "stop" and parser.calls else finish


async def chunks(state: ServerState, body: ChatCompletionRequest, gen: GenerateRequest, choices: list[Choice],
                 model: str, parser: Callable[[Choice], OutputParser]) -> AsyncIterator[ChatCompletionChunk]:
    chunk_id = ChatCompletionChunk(model=model, choices=[]).id
    parsers = {c.index: parser(c) for c in choices}
    continuous = body.continuous_usage
    for c in choices:
        yield ChatCompletionChunk(id=chunk_id, model=model, usage=usage_so_far(c) if continuous else None, choices=[
            ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=body.echoed()))],
            prompt_token_ids=c.prompt_ids if body.return_token_ids else None)
    scored: set[int] = set()  # choices whose prompt logprobs went out
    held = {c.index: "" for c in choices}  # reasoning not yet sent (stream_reasoning false)
    async for choice, out in outputs(state, choices):
        parser = parsers[choice.index]
        made = parser.calls
        delta = parser.feed(out.text)
        if out.finish_reason:
            delta += parser.finish(out.finish_reason)
        delta = body.shown(delta)
        if not body.stream_reasoning:
            held[choice.index] += delta.reasoning
            delta.reasoning = ""
            if delta.content or delta.calls or out.finish_reason:  # the thinking is complete
                delta.reasoning, held[choice.index] = held[choice.index], ""
        prompt_logprobs = None
        if body.prompt_logprobs is not None and choice.index not in scored:
            scored.add(choice.index)
            prompt_logprobs = vllm_prompt_logprobs(choice.prompt_logprobs or [])
        if (delta.content or delta.reasoning or delta.calls or out.finish_reason or out.logprobs or prompt_logprobs
                or (body.return_token_ids and out.new_ids)):
            calls = [DeltaToolCall(index=made + i, function=ResponseFunction(name=call.name, arguments=call.arguments))
                     for i, call in enumerate(delta.calls)] or None
            yield ChatCompletionChunk(id=chunk_id, model=model, choices=[ChatChunkChoice(
                index=choice.index, delta=DeltaMessage(content=delta.content or content_or_nothing(delta, calls),
                                                       reasoning_content=delta.reasoning or None,
                                                       reasoning=delta.reasoning or None, tool_calls=calls),
                logprobs=chat_logprobs(out.logprobs, body.return_tokens_as_token_ids) if out.logprobs else None,
                finish_reason=finish_reason(out.finish_reason, parser),
                token_ids=out.new_ids if body.return_token_ids else None)],
                usage=usage_so_far(choice) if continuous else None, prompt_logprobs=prompt_logprobs)
        if out.finish_reason and body.return_hidden_states:
            yield ChatCompletionChunk(id=chunk_id, model=model, choices=[ChatChunkChoice(
                index=choice.index, delta=DeltaMessage(hidden_states=choice.hidden_states))])
    if body.include_usage:
        yield ChatCompletionChunk(id=chunk_id, model=model, choices=[], usage=usage(choices, gen.prompts))
