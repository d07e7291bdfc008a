"""Tool calls through the real server and the real `openai` client: calls forced by tool_choice (named,
required) on the tiny random model, calls the model "chooses" (auto, its output scripted by a regex) found by
--tool-call-parser, the round trip with the tool's result, and every way to get tools wrong."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_fixtures import Server, pages_all_free, serving
from template_models import with_chat_template
from transformers import AutoTokenizer

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_OUTPUT = ('Checking\\.\n<tool_call>\n\\{"name": "get_weather", "arguments": '
                 '\\{"city": "Paris", "days": [1-7]\\}\\}\n</tool_call>')


@pytest.fixture(scope="module")
def model(tiny_models, tmp_path_factory) -> str:
    return with_chat_template(tiny_models["qwen3"], tmp_path_factory.mktemp("tools") / "qwen3-tools")


@pytest.fixture(scope="module")
def server(model):
    with serving(model, "--tool-call-parser", "hermes") as srv:
        yield srv


def streamed(chunks) -> tuple[list[str], list[list], list[str]]:
    """Per choice: content, tool calls (each delta's calls, merged by index), finish reason."""
    content, calls, finish = {}, {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            for call in c.delta.tool_calls or []:
                calls.setdefault(c.index, {})[call.index] = call
            finish[c.index] = c.finish_reason or finish.get(c.index)
    order = sorted(finish)
    return ([content[i] for i in order], [[v for _, v in sorted(calls.get(i, {}).items())] for i in order],
            [finish[i] for i in order])


def test_named_tool_call_round_trip(client, model):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                          max_tokens=60, seed=3)
    message, finish = resp.choices[0].message, resp.choices[0].finish_reason
    assert finish == "tool_calls" and message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)

    follow_up = ASK + [message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}]
    answer = client.chat.completions.create(model="tiny", messages=follow_up, tools=TOOLS, max_tokens=5,
                                            tool_choice="none")
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
    tokenizer = AutoTokenizer.from_pretrained(model)  # what the template makes of the same conversation
    rendered = tokenizer.apply_chat_template(
        follow_up[:1] + [{"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)}}]}] + follow_up[2:],
        tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in rendered and '"name": "get_time"' in rendered
    assert f'"arguments": {call.function.arguments}' in rendered
    assert answer.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def test_named_tool_call_streamed(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=40, n=3, stream=True))
    contents, calls, finishes = streamed(chunks)
    assert contents == [""] * 3 and finishes == ["tool_calls"] * 3
    for [call] in calls:
        assert call.function.name == "get_time" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_makes_every_sampled_choice_call_a_tool(client, parallel):
    resp = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", n=8,
                                          seed=11, temperature=1.0, max_tokens=1000, parallel_tool_calls=parallel)
    counts = []
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls", choice
        counts.append(len(choice.message.tool_calls))
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert min(counts) >= 1 and (max(counts) == 1 if not parallel else True)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_finds_the_call_the_model_writes(client, stream):
    """The model's output is scripted by a regex into Qwen's format; the hermes parser finds the call in it."""
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, extra_body={"regex": HERMES_OUTPUT})
    if stream:
        [content], [calls], [finish] = streamed(client.chat.completions.create(**kwargs, stream=True))
    else:
        resp = client.chat.completions.create(**kwargs)
        content, calls, finish = resp.choices[0].message.content, resp.choices[0].message.tool_calls, \
            resp.choices[0].finish_reason
    assert content == "Checking.\n" and finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments)["city"] == "Paris"


def test_tool_choice_none_leaves_the_text_alone(client):
    text = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>"
    resp = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=80, extra_body={"regex": text.replace("{", "\\{")
                                                                     .replace("}", "\\}")})
    assert resp.choices[0].message.content == text and resp.choices[0].message.tool_calls is None
    assert resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not found in tools list"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "distinct"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tool_choice", "Unsupported type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", ""),
])
def test_tools_gotten_wrong_are_400s_naming_the_field(server, body, param, words):
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": ASK} | body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert words in resp.json()["error"]["message"]
    assert pages_all_free(server.info())


def test_a_server_without_parser_or_tool_template_says_so(tiny_models):
    srv = Server(tiny_models["qwen3"])  # its template knows nothing of tools; no --tool-call-parser
    try:
        auto = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, "tools": TOOLS})
        assert auto.status_code == 400 and auto.json()["error"]["param"] == "tools"
        assert "--tool-call-parser" in auto.json()["error"]["message"]
        forced = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, "tools": TOOLS,
                                                                    "tool_choice": "required"})
        assert forced.status_code == 400 and forced.json()["error"]["param"] == "tools"
        assert "chat template does not show tools" in forced.json()["error"]["message"]
    finally:
        assert srv.stop() == 0


def test_llama3_parser_finds_json_calls(model):
    srv = Server(model, "--tool-call-parser", "llama3")
    try:
        client = srv.openai_client()
        regex = '\\{"name": "get_time", "parameters": \\{"zone": "(UTC|CET)"\\}\\}'
        resp = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60,
                                              extra_body={"regex": regex})
        [call] = resp.choices[0].message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
        assert resp.choices[0].message.content is None and resp.choices[0].finish_reason == "tool_calls"
    finally:
        assert srv.stop() == 0
