"""Tool calls in a model's output text, in the formats models are trained to write them.

- `hermes` (alias `qwen`, `qwen25`): Qwen2.5/Qwen3 and Hermes write each call as
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, with ordinary text around them.
- `llama3`: Llama 3.1/3.2 write the whole answer as `{"name": ..., "parameters": {...}}` (several joined
  by `;`, optionally after `<|python_tag|>`), or plain text.
- `mistral`: Mistral 7B v0.3 writes text, then `[TOOL_CALLS]` and one JSON array of
  `{"name": ..., "arguments": {...}}`.

A parser is fed text deltas and returns what can be shown now as content, plus the calls completed so
far; text that may still turn out to be part of a call is held back. A block that does not hold a valid
call is given back as content, never dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from minisgl.server.parsers.markers import scan


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class Parsed:
    """What a piece of output turned out to be: text to show, and completed calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __add__(self, other: Parsed) -> Parsed:
        return Parsed(self.content + other.content, self.calls + other.calls)


def call_from(obj: object, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A call from a decoded JSON value `{"name": str, "arguments" | "parameters": object}`; None if not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[key] for key in arguments_keys if key in obj), {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks among text."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buffer, self.inside = "", False

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        while True:
            if not self.inside:
                before, self.buffer, self.inside = scan(self.buffer, self.OPEN)
                out.content += before
                if not self.inside:
                    return out
            else:
                end = self.buffer.find(self.CLOSE)
                if end < 0:
                    return out
                out += self._block(self.buffer[:end], closed=True)
                self.buffer, self.inside = self.buffer[end + len(self.CLOSE):], False

    def finish(self) -> Parsed:
        """The output ended: a block left open still counts if it holds a whole call (a model may stop
        right after the JSON)."""
        rest, self.buffer = self.buffer, ""
        return self._block(rest, closed=False) if self.inside else Parsed(rest)

    def _block(self, body: str, closed: bool) -> Parsed:
        try:
            call = call_from(json.loads(body))
        except ValueError:
            call = None
        if call is not None:
            return Parsed(calls=[call])
        return Parsed(self.OPEN + body + (self.CLOSE if closed else ""))


class Llama3JsonParser:
    """The whole output is JSON calls, or it is text: decided by its first characters."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.buffer, self.calls_mode = "", None  # None: undecided yet

    def feed(self, text: str) -> Parsed:
        if self.calls_mode is False:
            return Parsed(text)
        self.buffer += text
        head = self.buffer.lstrip()
        if self.calls_mode is None and head:
            if head.startswith(("{", self.TAG)):
                self.calls_mode = True
            elif not self.TAG.startswith(head):
                self.calls_mode = False
                rest, self.buffer = self.buffer, ""
                return Parsed(rest)
        return Parsed()

    def finish(self) -> Parsed:
        rest, self.buffer = self.buffer, ""
        calls = parse_json_calls(rest) if self.calls_mode else None
        return Parsed(calls=calls) if calls else Parsed(rest)


class MistralParser:
    """Text, then `[TOOL_CALLS]` and a JSON array of calls to the end of the output."""

    TAG = "[TOOL_CALLS]"

    def __init__(self) -> None:
        self.buffer, self.inside = "", False

    def feed(self, text: str) -> Parsed:
        if self.inside:
            self.buffer += text
            return Parsed()
        before, self.buffer, self.inside = scan(self.buffer + text, self.TAG)
        return Parsed(before)

    def finish(self) -> Parsed:
        rest, self.buffer = self.buffer, ""
        if not self.inside:
            return Parsed(rest)
        try:
            value = json.loads(rest)
        except ValueError:
            value = None
        calls = [call_from(item, ("arguments",)) for item in value] if isinstance(value, list) else []
        return Parsed(calls=calls) if calls and None not in calls else Parsed(self.TAG + rest)


def parse_json_calls(text: str) -> list[ToolCall] | None:
    """`{call}; {call}` (after an optional <|python_tag|>) as calls; None unless the whole text is calls."""
    text = text.strip().removeprefix(Llama3JsonParser.TAG)
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        call = call_from(obj)
        if call is None:
            return None
        calls.append(call)


# ---------------------------------------------------------------- calls forced by tool_choice


def forced_schema(functions: dict[str, dict], name: str | None, parallel: bool) -> dict:
    """The JSON schema a forced choice constrains the output to: a named function's arguments object,
    or for `required` an array of `{"name", "parameters"}` calls to any of them (one or more)."""
    if name is not None:
        return functions[name]
    defs: dict[str, Any] = {}
    calls = [{"type": "object", "properties": {"name": {"const": fn}, "parameters": hoist_defs(fn, params, defs)},
              "required": ["name", "parameters"]} for fn, params in functions.items()]
    return ({"type": "array", "items": {"anyOf": calls}, "minItems": 1} | ({} if parallel else {"maxItems": 1})
            | ({"$defs": defs} if defs else {}))


LOCAL_REFS = ("#/$defs/", "#/definitions/")


def hoist_defs(fn: str, params: dict, defs: dict[str, Any]) -> dict:
    """`params` for nesting inside a larger schema: its `$defs` (or `definitions`) move into `defs`, named
    `fn.X`, and its references follow them; left in place, `#/$defs/X` would point at the outer schema's root."""
    local = {**params.get("definitions", {}), **params.get("$defs", {})}
    if not local:
        return params

    def moved(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: (f"#/$defs/{fn}.{value.split('/', 2)[2]}" if key == "$ref" and isinstance(value, str)
                          and value.startswith(LOCAL_REFS) else moved(value)) for key, value in node.items()}
        return [moved(item) for item in node] if isinstance(node, list) else node

    defs.update({f"{fn}.{def_name}": moved(schema) for def_name, schema in local.items()})
    return moved({key: value for key, value in params.items() if key not in ("$defs", "definitions")})


def forced_calls(text: str, name: str | None) -> list[ToolCall] | None:
    """The calls in an output `forced_schema` shaped; None if it is not whole (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if name is not None:
        return [ToolCall(name, text)] if isinstance(value, dict) else None
    calls = [call_from(item, ("parameters",)) for item in value] if isinstance(value, list) else [None]
    return calls if calls and None not in calls else None


TOOL_CALL_PARSERS = {"hermes": HermesParser, "qwen": HermesParser, "qwen25": HermesParser, "llama3": Llama3JsonParser,
                     "mistral": MistralParser}
