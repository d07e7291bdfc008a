"""What the chat-style APIs (chat completions, its batch, Responses) share between their schemas and their
plans: the tools a request offers as a ToolUse (and the grammar a forced call is held to), the messages as a
Conversation for the chat template, and a choice's output parser."""

from __future__ import annotations

import json
from typing import Any, Literal

from minisgl.core import Constraint
from minisgl.server.errors import ApiError
from minisgl.server.parsers.output import OutputParser, ToolUse
from minisgl.server.parsers.reasoning import ReasoningParser
from minisgl.server.parsers.tools import forced_schema
from minisgl.server.text import Conversation

ToolChoice = Literal["none", "auto", "required"] | None

THINKING_HINT = "Think step by step and use fewer than {} reasoning tokens before the final answer."


def tool_use(functions: dict[str, dict[str, Any]] | None, choice: ToolChoice, named: str | None, parallel: bool,
             parser: str | None) -> ToolUse | None:
    """How the output may hold calls of `functions` (name -> parameters schema; None: no tools), given the
    tool_choice (`named`: the function it names) and the server's --tool-call-parser; None when it may not."""
    if functions is None:
        if named is not None or choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    if named is not None:
        if named not in functions:
            raise ApiError(400, f"Tool {named!r} not found in tools list (tool_choice names it)", param="tool_choice")
        return ToolUse("named", named, parser, parallel)
    if choice != "required" and parser is None:
        raise ApiError(400, "this server runs without --tool-call-parser, so it cannot find the calls a model "
                            "chooses to make; send tool_choice 'required', a named function or 'none'",
                       param="tool_choice" if choice else "tools")
    return ToolUse("required" if choice == "required" else "auto", None, parser, parallel)


def functions(tools: list[tuple[str, dict[str, Any] | None]] | None) -> dict[str, dict[str, Any]] | None:
    """The tools' functions as (name, parameters schema) -> name -> schema (an object when left out; None: no
    tools); their names must differ (a call names its function)."""
    if not tools:
        return None
    named = {name: parameters or {"type": "object"} for name, parameters in tools}
    if len(named) < len(tools):
        raise ApiError(400, "tools must have distinct function names", param="tools")
    return named


def forced_call(functions: dict[str, dict[str, Any]], use: ToolUse | None) -> list[tuple[str, Constraint]]:
    """The grammar a forced tool choice (required, or a named function) holds the output to: the functions'
    parameter schemas."""
    if use is None or use.mode == "auto":
        return []
    schema = forced_schema(functions, use.name, use.parallel)
    return [("tool_choice", Constraint("json_schema", json.dumps(schema)))]


def with_thinking_hint(messages: list[dict], budget: int | None) -> list[dict]:
    """vLLM's prompt for a thinking budget: its hint ends a leading system message, or is one of its own first,
    so that the model plans for the budget the engine enforces."""
    if budget in (None, -1):
        return messages
    hint = THINKING_HINT.format(budget)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{hint}"}, *messages[1:]]
    return [{"role": "system", "content": hint}, *messages]


def output_parser(use: ToolUse | None, reasoning: str | None, prompt_text: str | None, constrained: bool,
                  separate_reasoning: bool = True) -> OutputParser:
    """A choice's parser. Under a grammar the output is what the grammar says from its first token on, even
    if the prompt opened a reasoning block (a grammar may still write one: it is split off)."""
    opened = "" if constrained else prompt_text or ""
    split = reasoning is not None and separate_reasoning
    return OutputParser(use, ReasoningParser(reasoning, opened) if split else None)


def conversation(messages: list[dict], tools: list[dict] | None, use: ToolUse | None,
                 template_kwargs: dict[str, Any] | None = None, **options: bool) -> Conversation:
    return Conversation(messages, tools, tools_needed=use is not None, template_kwargs=template_kwargs or {},
                        **options)
