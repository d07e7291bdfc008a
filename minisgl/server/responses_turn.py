"""One turn of the Responses API, on the one pipeline: a create request as a plan (`instructions` a system
message, `input` the conversation after the stored one `previous_response_id` names, `max_output_tokens` the
max_tokens, `text.format` the output's grammar), and its run given back as the response object, its stream of
named events, or generated behind (`background`). HTTP (routes/responses.py) and the WebSocket mode
(routes/responses_ws.py) both run turns.

Function tools are served as on chat completions; each call the model makes is a `function_call` output item.
With --reasoning-parser the model's thinking is a `reasoning` output item before the message.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, AsyncIterator, Callable

from fastapi.responses import Response
from pydantic import BaseModel

from minisgl.core import Constraint
from minisgl.messages import LogprobEntry
from minisgl.server.boundary import CheckedRequest
from minisgl.server.conversations import conversation, forced_call, functions, output_parser, tool_use
from minisgl.server.errors import ApiError, failure
from minisgl.server.parsers.output import ChoiceDelta, OutputParser, ToolUse
from minisgl.server.parsers.tools import ToolCall
from minisgl.server.pipeline import Answer, Choice, outputs, usage
from minisgl.server.plan import Output, Plan
from minisgl.server.responses_store import ResponseStore, Stored
from minisgl.server.schemas.chat import ChatMessage
from minisgl.server.schemas.logprobs import TokenLogprob, chat_logprobs
from minisgl.server.schemas.responses import (
    OUTPUT_LOGPROBS,
    FunctionCallItem,
    FunctionToolChoice,
    JsonObjectFormat,
    JsonSchemaTextFormat,
    MessageItem,
    OutputTextPart,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    as_messages,
    finished,
)
from minisgl.server.schemas.types import Usage
from minisgl.server.state import ServerState


def responses_tool_use(body: ResponsesRequest, parser: str | None) -> ToolUse | None:
    choice = body.tool_choice
    named = choice.name if isinstance(choice, FunctionToolChoice) else None
    if not body.tools and choice == "auto":
        choice = None  # without tools, auto (OpenAI's default) is no call
    return tool_use(functions(tool_functions(body)), None if named else choice, named,
                    body.parallel_tool_calls is not False, parser)


def tool_functions(body: ResponsesRequest) -> list[tuple[str, dict | None]] | None:
    return [(tool.name, tool.parameters) for tool in body.tools] if body.tools else None


def text_format(body: ResponsesRequest) -> list[tuple[str, Constraint]]:
    """The grammar `text.format` holds the output to (none for plain text)."""
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, JsonObjectFormat):
        return [("text.format", Constraint("json_object"))]
    if isinstance(fmt, JsonSchemaTextFormat):
        return [("text.format", Constraint("json_schema", json.dumps(fmt.schema_)))]
    return []


def responses_plan(body: ResponsesRequest, history: list[dict], use: ToolUse | None) -> Plan:
    """A create request as the pipeline's plan, after `history` (the conversation it continues)."""
    if body.background and not body.stored:
        raise ApiError(400, "background can only be used when `store` is true", param="background")
    if body.background and body.stream:
        raise ApiError(400, "background responses are not streamed here; poll GET /v1/responses/{id}",
                       param="background")
    turns = history + body.turns()
    if not any(turn["role"] != "assistant" for turn in turns):
        raise ApiError(400, "input holds no message", param="input")
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    tools = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
             for tool in body.tools] if body.tools else None
    thinking_off = body.reasoning is not None and body.reasoning.effort == "none"
    messages = [ChatMessage.model_validate(turn).template_form() for turn in system + turns]  # as chat renders them
    prompt = conversation(messages, tools, use, {"enable_thinking": False} if thinking_off else None)
    # A forced call decides this turn's output (OpenAI's and vLLM's reading): text.format is for text answers.
    constraints = forced_call(functions(tool_functions(body)) or {}, use) or text_format(body)
    logprobs = wants_logprobs(body)
    if body.top_logprobs is not None and not logprobs:
        raise ApiError(400, f"top_logprobs needs include {OUTPUT_LOGPROBS!r}", param="top_logprobs")
    return Plan(model=body.model, prompt=prompt, sampling=body.common_sampling() | {
        "max_tokens": body.max_output_tokens, "logprobs": (body.top_logprobs or 0) if logprobs else None},
        renamed={"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}, constraints=constraints,
        logprob_counts={"top_logprobs": body.top_logprobs} if body.top_logprobs is not None else {},
        user=body.user, output=Output(stream=body.stream, background=bool(body.background)))


def wants_logprobs(body: ResponsesRequest) -> bool:
    return OUTPUT_LOGPROBS in (body.include or [])


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


class ResponsesAnswer(Answer):
    """A turn's run given back: the response object (filled in as it runs), or its named events; `keep` is
    handed the finished (or failed) response, before a stream's last event is sent."""

    named = True

    def __init__(self, body: ResponsesRequest, history: list[dict], plan: Plan, use: ToolUse | None,
                 state: ServerState, store: ResponseStore, keep: Callable[[Stored], None] | None):
        self.body, self.history, self.use, self.state = body, history, use, state
        self.store, self.keep = store, keep
        self.constrained, self.output = bool(plan.constraints), plan.output
        self.head = head_of(body, state.args.served_model_name)
        self.numbers = itertools.count()  # the stream's sequence numbers

    def parser(self, choice: Choice) -> OutputParser:
        return output_parser(self.use, self.state.args.reasoning_parser, choice.prompt_text, self.constrained)

    def entry(self) -> Stored:
        """What the store keeps of this response."""
        return Stored(self.head, self.history + self.body.turns() + as_messages(self.head.output),
                      self.body.listed_input())

    def stored(self) -> None:
        if self.keep:
            self.keep(self.entry())

    def filled(self, choice: Choice, usage: Usage) -> ResponseObject:
        """The response once its sequence has run to its end: its output items, usage and status."""
        parser = self.parser(choice)
        delta = parser.step(choice.text, choice.finish)
        part = OutputTextPart(text=delta.content, logprobs=self.logprobs(choice.logprobs))
        message = [MessageItem(content=[part])] if delta.content or not delta.calls else []
        self.head.output = ([ReasoningItem(content=[ReasoningText(text=delta.reasoning)])] if delta.reasoning
                            else []) + message + [FunctionCallItem(name=call.name, arguments=call.arguments)
                                                  for call in delta.calls]
        self.head.usage = ResponseUsage.of(usage)
        return finished(self.head, choice.finish)

    def logprobs(self, entries: list[LogprobEntry]) -> list[TokenLogprob]:
        """The output tokens' logprobs, as an output_text part has them (include message.output_text.logprobs;
        all the output's tokens, reasoning and calls too, go with its text)."""
        return chat_logprobs(entries, self.output.tokens_as_ids).content

    def whole(self, choices: list[Choice], usage: Usage) -> ResponseObject:
        head = self.filled(choices[0], usage)
        self.stored()
        return head

    def fail(self, error: ApiError) -> None:
        self.head.status, self.head.error = "failed", {"code": error.type, "message": error.message}
        self.stored()

    def failed(self, error: ApiError) -> dict:
        self.fail(error)
        return self.event("response.failed", response=dump(self.head))

    def behind(self, state: ServerState, checked: CheckedRequest, choices: list[Choice]) -> Response:
        """background: answered at once (queued); generated behind, then stored with its output or error.
        Cancelled (POST .../cancel, DELETE), it stops where it is; leaving `outputs` aborts the sequence."""
        self.head.status = "queued"
        answer = self.head.model_dump_json()

        async def generate() -> None:
            self.head.status = "in_progress"
            try:
                async for _ in outputs(state, choices):
                    pass
            except Exception as exc:  # a failed sequence, or a bug: the response must still end (failed)
                return self.fail(failure(exc))
            self.whole(choices, usage(choices, checked.prompts))

        self.store.run_behind(self.entry(), generate())
        return Response(answer, media_type="application/json")

    def event(self, kind: str, **fields: Any) -> dict:
        return {"type": kind, "sequence_number": next(self.numbers), **fields}

    async def stream(self, checked: CheckedRequest, choices: list[Choice]) -> AsyncIterator[dict]:
        """response.created, the output items' events (OutputEvents), then response.completed (or .incomplete;
        a failure ends it with .failed: see `failed`)."""
        head, [choice] = self.head, choices
        parser, items = self.parser(choice), OutputEvents(self.event)
        yield self.event("response.created", response=dump(head))
        yield self.event("response.in_progress", response=dump(head))
        async for _, out in outputs(self.state, choices):
            items.pending += self.logprobs(out.logprobs)
            for event in items.said(parser.step(out.text, out.finish_reason)):
                yield event
        for event in items.ended():
            yield event
        head.output, head.usage = items.items, ResponseUsage.of(usage(choices, checked.prompts))
        done = finished(head, choice.finish)
        self.stored()
        yield self.event("response.incomplete" if done.status == "incomplete" else "response.completed",
                         response=dump(done))


class OutputEvents:
    """A streamed response's output items as named events: each item opened, filled by deltas and closed (a
    function call whole, its arguments in one delta). `pending`: output logprobs not yet sent with a text
    delta (they go with the next one, or with the message's done event)."""

    def __init__(self, event: Callable[..., dict]):
        self.event = event  # a numbered event of the response's stream
        self.items: list[ReasoningItem | MessageItem | FunctionCallItem] = []
        self.pending: list[TokenLogprob] = []

    def said(self, delta: ChoiceDelta) -> list[dict]:
        """The events of one parsed delta: its reasoning, its text, its calls."""
        events = []
        for text, kind in ((delta.reasoning, ReasoningItem), (delta.content, MessageItem)):
            if text:
                events += self.opened(kind) + [self.text_delta(text)]
        return events + [event for call in delta.calls for event in self.called(call)]

    def ended(self) -> list[dict]:
        """The events that end the output: the open item closed; a response without calls ends with a message
        item, even an empty one."""
        if any(isinstance(item, FunctionCallItem) for item in self.items):
            return self.closed() if self.items[-1].status == "in_progress" else []
        return self.opened(MessageItem) + self.closed()

    def open(self, kind: type) -> bool:
        return bool(self.items) and isinstance(self.items[-1], kind) and self.items[-1].status == "in_progress"

    def opened(self, kind: type) -> list[dict]:
        """An item of `kind` open to write in: the open one, or a new one (the open item of another kind
        closed first)."""
        if self.open(kind):
            return []
        events = self.closed() if self.items and self.items[-1].status == "in_progress" else []
        item = kind(status="in_progress")
        self.items.append(item)
        index = len(self.items) - 1
        part = ReasoningText(text="") if kind is ReasoningItem else OutputTextPart(text="")
        events.append(self.event("response.output_item.added", output_index=index, item=dump(item)))
        if kind is MessageItem:
            events.append(self.event("response.content_part.added", item_id=item.id, output_index=index,
                                     content_index=0, part=dump(part)))
        item.content.append(part)
        return events

    def text_delta(self, text: str) -> dict:
        """Text added to the open item; a message's text carries the logprobs so far."""
        item, index = self.items[-1], len(self.items) - 1
        item.content[0].text += text
        if isinstance(item, ReasoningItem):
            return self.event("response.reasoning_text.delta", item_id=item.id, output_index=index, content_index=0,
                              delta=text)
        carried, self.pending = self.pending, []
        item.content[0].logprobs += carried
        return self.event("response.output_text.delta", item_id=item.id, output_index=index, content_index=0,
                          delta=text, logprobs=dump_all(carried))

    def closed(self) -> list[dict]:
        """The open item completed."""
        item, index = self.items[-1], len(self.items) - 1
        item.status = "completed"
        part = item.content[0]
        if isinstance(item, ReasoningItem):
            events = [self.event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                 content_index=0, text=part.text)]
        else:
            part.logprobs += self.pending  # what no text delta carried
            self.pending = []
            events = [self.event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                                 text=part.text, logprobs=dump_all(part.logprobs)),
                      self.event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                                 part=dump(part))]
        return events + [self.event("response.output_item.done", output_index=index, item=dump(item))]

    def called(self, call: ToolCall) -> list[dict]:
        """A function call, whole: its item opened, its arguments in one delta, the item closed."""
        events = self.closed() if self.items and self.items[-1].status == "in_progress" else []
        item = FunctionCallItem(name=call.name, arguments="", status="in_progress")
        self.items.append(item)
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=dump(item)))
        item.arguments, item.status = call.arguments, "completed"
        return events + [
            self.event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                       delta=call.arguments),
            self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                       arguments=call.arguments),
            self.event("response.output_item.done", output_index=index, item=dump(item))]


def dump(model: BaseModel) -> dict:
    return model.model_dump(mode="json")


def dump_all(models: list[BaseModel]) -> list[dict]:
    return [dump(model) for model in models]
