"""POST /v1/chat/completions and vLLM's /v1/chat/completions/batch: the request as a plan, and its run given
back as the chat answer or its stream of chunks.

Tools: the chat template renders `tools`; with tool_choice `auto` the server's --tool-call-parser finds
the calls the model writes, `required` and a named function force them through a grammar (see
parsers/tools.py). A choice that ends in calls has `finish_reason: "tool_calls"`. With --reasoning-parser
the model's `<think>` block becomes `reasoning_content` (and vLLM's `reasoning`: parsers/reasoning.py).
"""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from minisgl.messages import LogprobEntry
from minisgl.server.boundary import CheckedRequest
from minisgl.server.conversations import (
    conversation,
    forced_call,
    functions,
    output_parser,
    tool_use,
    with_thinking_hint,
)
from minisgl.server.errors import ApiError, error_responses
from minisgl.server.parsers.output import ChoiceDelta, OutputParser, ToolUse
from minisgl.server.pipeline import Answer, Choice, Chunks, generation_responses, outputs, respond
from minisgl.server.plan import Plan, PromptInput, vllm_plan
from minisgl.server.schemas.chat import (
    BatchChatCompletionRequest,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    DeltaToolCall,
    NamedToolChoice,
    ResponseFunction,
    ResponseToolCall,
)
from minisgl.server.schemas.logprobs import ChatLogprobs, chat_logprobs, vllm_prompt_logprobs
from minisgl.server.schemas.types import Usage
from minisgl.server.state import ServerState, server_state

router = APIRouter()


def chat_prompt(body: ChatCompletionRequest, use: ToolUse | None, messages: list[ChatMessage]) -> PromptInput:
    """The conversation to put through the chat template or, as vLLM takes them, token ids already templated:
    then the template's options would do nothing, and are refused."""
    if body.prompt_token_ids is None:
        if not messages:
            raise ApiError(400, "messages must not be empty (or send prompt_token_ids)", param="messages")
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        turns = with_thinking_hint([m.template_form() for m in messages], body.thinking_token_budget)
        return conversation(turns, tools, use, body.chat_template_kwargs, **body.template_options())
    if messages:
        raise ApiError(400, "send messages or prompt_token_ids, not both", param="prompt_token_ids")
    template_options = {"add_generation_prompt": body.add_generation_prompt is not None,
                        "continue_final_message": body.continue_final_message, "echo": body.echo,
                        "chat_template_kwargs": body.chat_template_kwargs is not None}
    for name, given in template_options.items():
        if given:
            raise ApiError(400, f"{name} applies to messages put through the chat template; prompt_token_ids "
                                f"are already templated", param=name)
    return [body.prompt_token_ids]


def chat_tool_use(body: ChatCompletionRequest, parser: str | None) -> ToolUse | None:
    choice = body.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return tool_use(chat_functions(body), None if named else choice, named, body.parallel_tool_calls, parser)


def chat_functions(body: ChatCompletionRequest) -> dict | None:
    return functions([(t.function.name, t.function.parameters) for t in body.tools] if body.tools else None)


def chat_plan(body: ChatCompletionRequest, use: ToolUse | None, prompt: PromptInput) -> Plan:
    """A chat request as the pipeline's plan (its batch too: `prompt` is then every conversation)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    by_completion = body.max_completion_tokens is not None
    sampling = {"max_tokens": body.max_completion_tokens if by_completion else body.max_tokens,
                "logprobs": (body.top_logprobs or 0) if body.logprobs else None}
    renamed = {"logprobs": "top_logprobs"} | ({"max_tokens": "max_completion_tokens"} if by_completion else {})
    counts = {name: count for name, count in (("top_logprobs", body.top_logprobs),
                                              ("prompt_logprobs", body.prompt_logprobs)) if count is not None}
    constraints = body.constraints() + body.vllm_constraints() + forced_call(chat_functions(body), use)
    return vllm_plan(body, prompt, sampling, body.prompt_logprobs, body.return_hidden_states, renamed=renamed,
                     constraints=constraints, logprob_counts=counts, special_tokens=body.add_special_tokens)


@router.post("/v1/chat/completions", response_model=None,
             responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk))
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           state: ServerState = Depends(server_state)) -> Response:
    use = chat_tool_use(body, state.args.tool_call_parser)
    plan = chat_plan(body, use, chat_prompt(body, use, body.messages))
    return await respond(request, state, plan, ChatAnswer(body, [body.messages], plan, use, state))


# Not in openapi.json: its body is chat's with `messages` a list of conversations (docs/compatibility.md). Listed,
# the schema fuzzer's conversations overflow a short test context in most batches (each must fit), which it reads
# as a schema that promises more than the route accepts.
@router.post("/v1/chat/completions/batch", response_model=ChatCompletionResponse, include_in_schema=False,
             responses=error_responses(400, 401, 404, 413, 500, 503))
async def batch_chat_completions(body: BatchChatCompletionRequest, request: Request,
                                 state: ServerState = Depends(server_state)) -> Response:
    """vLLM's: several conversations in one request, each answered as /v1/chat/completions would answer it
    alone, in one response whose choice `index` is the conversation's (times n, plus the sample)."""
    use = chat_tool_use(body, state.args.tool_call_parser)
    plan = chat_plan(body, use, [chat_prompt(body, use, messages) for messages in body.messages])
    return await respond(request, state, plan, ChatAnswer(body, body.messages, plan, use, state))


class ChatAnswer(Answer):
    """A chat run given back: each choice's output parsed (reasoning, tool calls), whole or as chunks."""

    def __init__(self, body: ChatCompletionRequest, conversations: list[list[ChatMessage]], plan: Plan,
                 use: ToolUse | None, state: ServerState):
        self.body, self.conversations, self.output, self.use = body, conversations, plan.output, use
        self.state, self.model = state, state.args.served_model_name
        self.reasoning, self.constrained = state.args.reasoning_parser, bool(plan.constraints)

    def parser(self, c: Choice) -> OutputParser:
        return output_parser(self.use, self.reasoning, c.prompt_text, self.constrained, self.body.separate_reasoning)

    def shown(self, delta: ChoiceDelta) -> ChoiceDelta:
        """What the answer shows of a parsed delta: its reasoning dropped when include_reasoning is false."""
        if not self.body.include_reasoning:
            delta.reasoning = ""
        return delta

    def echoed(self, c: Choice) -> str:
        """What `echo` puts before a choice's content: its conversation's last message when the assistant's."""
        messages = self.conversations[c.prompt]
        last = messages[-1] if messages else None
        return last.text() if self.body.echo and last is not None and last.role == "assistant" else ""

    def logprobs(self, entries: list[LogprobEntry]) -> ChatLogprobs | None:
        return chat_logprobs(entries, self.output.tokens_as_ids) if entries else None

    def whole(self, choices: list[Choice], usage: Usage) -> ChatCompletionResponse:
        answers = []
        for c in choices:
            parsed = self.parser(c)
            delta = self.shown(parsed.step(c.text, c.finish))
            content = self.echoed(c) + delta.content
            message = ChatResponseMessage(
                content=None if delta.calls and not content.strip() else content,
                reasoning_content=delta.reasoning or None, reasoning=delta.reasoning or None,
                tool_calls=[ResponseToolCall.of(call) for call in delta.calls] or None)
            answers.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason(c.finish, parsed),
                                      logprobs=self.logprobs(c.logprobs), matched_stop=c.matched_stop,
                                      token_ids=c.token_ids if self.body.return_token_ids else None,
                                      hidden_states=c.hidden_states if self.output.hidden_states else None))
        first = choices[0]
        return ChatCompletionResponse(
            model=self.model, usage=usage, choices=answers,
            prompt_logprobs=vllm_prompt_logprobs(first.prompt_logprobs, self.body.prompt_logprobs),
            prompt_token_ids=first.prompt_ids if self.body.return_token_ids and len(self.conversations) == 1
            else None)  # a batch has no one prompt to describe

    async def stream(self, checked: CheckedRequest, choices: list[Choice]) -> AsyncIterator[ChatCompletionChunk]:
        body, chunks = self.body, Chunks(ChatCompletionChunk, self.model, self.output, self.body.prompt_logprobs)
        parsers = {c.index: self.parser(c) for c in choices}
        for c in choices:
            yield chunks.chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant",
                                                                                  content=self.echoed(c)))],
                               c, prompt_token_ids=c.prompt_ids if body.return_token_ids else None)
        held = {c.index: "" for c in choices}  # reasoning not yet sent (stream_reasoning false)
        async for choice, out in outputs(self.state, choices):
            parser = parsers[choice.index]
            made = parser.calls
            delta = self.shown(parser.step(out.text, out.finish_reason))
            if not body.stream_reasoning:
                held[choice.index] += delta.reasoning
                delta.reasoning = ""
                if delta.content or delta.calls or out.finish_reason:  # the thinking is complete
                    delta.reasoning, held[choice.index] = held[choice.index], ""
            prompt_logprobs = chunks.prompt_logprobs(choice)
            if (delta.content or delta.reasoning or delta.calls or out.finish_reason or out.logprobs
                    or prompt_logprobs or (body.return_token_ids and out.new_ids)):
                calls = [DeltaToolCall(index=made + i, function=ResponseFunction(name=call.name,
                                                                                 arguments=call.arguments))
                         for i, call in enumerate(delta.calls)] or None
                yield chunks.chunk([ChatChunkChoice(
                    index=choice.index, delta=DeltaMessage(content=delta.content or content_or_nothing(delta, calls),
                                                           reasoning_content=delta.reasoning or None,
                                                           reasoning=delta.reasoning or None, tool_calls=calls),
                    logprobs=self.logprobs(out.logprobs), finish_reason=finish_reason(out.finish_reason, parser),
                    token_ids=out.new_ids if body.return_token_ids else None)], choice,
                    prompt_logprobs=prompt_logprobs)
            for chunk in chunks.hidden_states(choice, out, lambda index, hidden: ChatChunkChoice(
                    index=index, delta=DeltaMessage(hidden_states=hidden))):
                yield chunk
        for chunk in chunks.last(checked, choices):
            yield chunk


def content_or_nothing(delta: ChoiceDelta, calls: list | None) -> str | None:
    """A delta with neither text, reasoning nor calls (a token still held back, the last chunk) has content
    "", as OpenAI's and SGLang's do: clients read delta.content as a string on every chunk after the first."""
    return None if delta.reasoning or calls else ""


def finish_reason(finish: str | None, parser: OutputParser) -> str | None:
    return "tool_calls" if finish == "stop" and parser.calls else finish
