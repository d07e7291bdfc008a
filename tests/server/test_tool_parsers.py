"""Tool-call parsers on scripted outputs: every output fed whole and split at every position (as a stream
may split it), and the forced-call schemas checked with jsonschema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers import splits

from minisgl.server.parsers.output import OutputParser, ToolUse
from minisgl.server.parsers.tools import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    Parsed,
    ToolCall,
    forced_calls,
    forced_schema,
)


def run(parser, pieces: list[str]) -> Parsed:
    out = Parsed()
    for piece in pieces:
        out += parser.feed(piece)
    return out + parser.finish()


WEATHER = ToolCall("get_weather", '{"city": "Paris", "days": 3}')
TIME = ToolCall("get_time", "{}")

HERMES_CASES = [
    ("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n"
     "</tool_call>", "Let me check.\n", [WEATHER]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>\n'
     '<tool_call>{"name": "get_time"}</tool_call>', "\n", [WEATHER, TIME]),
    ("No tools needed: 1 < 2 and <tool is not a tag.", "No tools needed: 1 < 2 and <tool is not a tag.", []),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"name": "get_time", "arguments": {}}', "", [TIME]),  # the model stopped before the close tag
    ("<tool_call>{\"name\": \"get_ti", "<tool_call>{\"name\": \"get_ti", []),  # cut by max_tokens
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
]


def test_hermes_shows_text_as_soon_as_it_cannot_be_a_tag():
    parser = HermesParser()
    assert parser.feed("Hello <to").content == "Hello "  # '<to' may begin <tool_call>: held back
    assert parser.feed("day").content == "<today"
    assert parser.feed(" <tool_call>{").content == " "
    assert parser.feed('"name": "get_time"}</tool_call>').calls == [TIME]


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "", [WEATHER]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; {"name": "get_time", '
     '"parameters": {}}', "", [WEATHER, TIME]),
    ("  The weather is fine.", "  The weather is fine.", []),
    ('{"name": "get_weather", "parameters": {"city": "Par', '{"name": "get_weather", "parameters": {"city": "Par', []),
    ('{"answer": 42}', '{"answer": 42}', []),
]


# SGLang's `mistral` parser (its tool-choice tests run a Mistral 7B v0.3 class with it).
MISTRAL_CASES = [
    ('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
     '{"name": "get_time", "arguments": {}}]', "Sure. ", [WEATHER, TIME]),
    ("No [TOOL or calls here.", "No [TOOL or calls here.", []),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par', '[TOOL_CALLS] [{"name": "get_weather", '
     '"arguments": {"city": "Par', []),  # cut by max_tokens: given back as text
    ('[TOOL_CALLS] [{"arguments": {}}]', '[TOOL_CALLS] [{"arguments": {}}]', []),  # no name
]


@pytest.mark.parametrize("parser, text, content, calls", [(HermesParser, *case) for case in HERMES_CASES] +
                         [(Llama3JsonParser, *case) for case in LLAMA_CASES] +
                         [(MistralParser, *case) for case in MISTRAL_CASES])
def test_calls_found_however_the_stream_splits_them(parser, text, content, calls):
    for pieces in splits(text):
        out = run(parser(), pieces)
        assert (out.content, out.calls) == (content, calls), pieces

def test_llama3_streams_text_once_it_cannot_be_a_call():
    parser = Llama3JsonParser()
    assert parser.feed(" ").content == "" and parser.feed("Sure").content == " Sure"
    assert parser.feed(", here").content == ", here"


PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
FUNCTIONS = {"get_weather": PARAMS, "get_time": {"type": "object"}}


def test_forced_schemas_accept_exactly_forced_outputs():
    named = forced_schema(FUNCTIONS, "get_weather", parallel=True)
    assert named == PARAMS
    required = forced_schema(FUNCTIONS, None, parallel=True)
    calls = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(calls, required)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}]):
        assert not jsonschema.Draft202012Validator(required).is_valid(bad)
    single = forced_schema(FUNCTIONS, None, parallel=False)
    assert not jsonschema.Draft202012Validator(single).is_valid(calls)
    assert forced_calls(json.dumps(calls), None) == [ToolCall("get_weather", '{"city": "Paris"}'), TIME]
    assert forced_calls('{"city": "Paris"}', "get_weather") == [ToolCall("get_weather", '{"city": "Paris"}')]
    assert forced_calls('{"city": "Pa', "get_weather") is None


def test_output_parser_by_tool_choice():
    text = '<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "get_time"}</tool_call>'
    auto = OutputParser(ToolUse("auto", parser="hermes"))
    assert auto.feed(text).calls == [TIME, TIME] and auto.calls == 2
    single = OutputParser(ToolUse("auto", parser="hermes", parallel=False))
    assert single.feed(text[:45]).calls == [TIME] and single.feed(text[45:]).calls == [] and single.calls == 1
    forced = OutputParser(ToolUse("named", "get_weather"))
    assert forced.feed('{"city": "Paris"}').content == ""
    assert forced.finish("stop").calls == [ToolCall("get_weather", '{"city": "Paris"}')]
    cut = OutputParser(ToolUse("named", "get_weather"))
    cut.feed('{"city": "Pa')
    assert cut.finish("length").content == '{"city": "Pa' and cut.calls == 0
    free = OutputParser(None)
    assert free.feed(text).content == text and free.finish("stop").content == ""
