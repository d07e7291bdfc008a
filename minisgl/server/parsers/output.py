"""One chat choice's output, as it streams: reasoning split off first (--reasoning-parser), then tool
calls split from the answer by the request's tool_choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from minisgl.server.parsers.reasoning import ReasoningParser, Split
from minisgl.server.parsers.tools import TOOL_CALL_PARSERS, Parsed, ToolCall, forced_calls


@dataclass
class ToolUse:
    """How a chat request's output may hold tool calls: `auto` (the model decides; the server's parser
    finds them), `named` (one call to `name`, forced by grammar) or `required` (one or more, forced)."""

    mode: Literal["auto", "named", "required"]
    name: str | None = None
    parser: str | None = None  # --tool-call-parser, for auto
    parallel: bool = True  # False: at most one call


@dataclass
class ChoiceDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""

    def __add__(self, other: ChoiceDelta) -> ChoiceDelta:
        return ChoiceDelta(self.content + other.content, self.calls + other.calls, self.reasoning + other.reasoning)


class OutputParser:
    """Feed a choice's text deltas, then its finish reason; get what to show of each."""

    def __init__(self, tools: ToolUse | None, reasoning: ReasoningParser | None = None):
        self.tools, self.reasoning = tools, reasoning
        self.parser = TOOL_CALL_PARSERS[tools.parser]() if tools and tools.mode == "auto" else None
        self.forced = "" if tools and tools.mode != "auto" else None  # a forced call's text, parsed at the end
        self.calls = 0

    def feed(self, text: str) -> ChoiceDelta:
        split = self.reasoning.feed(text) if self.reasoning else Split(content=text)
        return self._answer(split.content, split.reasoning)

    def step(self, text: str, finish_reason: str | None) -> ChoiceDelta:
        """Feed a text delta and, once the choice has ended (`finish_reason`), flush what was held back."""
        delta = self.feed(text)
        return delta + self.finish(finish_reason) if finish_reason is not None else delta

    def finish(self, finish_reason: str | None) -> ChoiceDelta:
        split = self.reasoning.finish() if self.reasoning else Split()
        delta = self._answer(split.content, split.reasoning)
        if self.forced is not None:
            calls = forced_calls(self.forced, self.tools.name) if finish_reason == "stop" else None
            return delta + self._counted(Parsed(calls=calls) if calls else Parsed(self.forced))
        return delta + self._counted(self.parser.finish() if self.parser else Parsed())

    def _answer(self, text: str, reasoning: str) -> ChoiceDelta:
        if self.forced is not None:
            self.forced += text
            return ChoiceDelta(reasoning=reasoning)
        delta = self._counted(self.parser.feed(text) if self.parser else Parsed(text))
        delta.reasoning = reasoning
        return delta

    def _counted(self, parsed: Parsed) -> ChoiceDelta:
        calls = parsed.calls if self.tools is None or self.tools.parallel else parsed.calls[: max(0, 1 - self.calls)]
        self.calls += len(calls)
        return ChoiceDelta(parsed.content, calls)
