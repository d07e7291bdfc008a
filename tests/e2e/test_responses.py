"""/v1/responses through the real server and the `openai` client's `responses.create`, streamed and not: the
same generation as the equivalent chat completion, the events in order, incomplete answers, structured output,
earlier outputs sent back as input, reasoning items, and what is refused."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_fixtures import Server, serving
from template_models import QWEN3_LIKE, with_chat_template
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

ASK = "Tell me about caches."
SYSTEM = "You are terse."


@pytest.fixture(scope="module")
def server(tiny_models):
    with serving(tiny_models["qwen3"]) as srv:
        yield srv


def test_a_response_is_the_chat_completion_of_the_same_conversation(client):
    resp = client.responses.create(model="tiny", input=ASK, instructions=SYSTEM, max_output_tokens=200,
                                   temperature=0, metadata={"run": "7"})
    chat = client.chat.completions.create(model="tiny", max_tokens=200, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.metadata == {"run": "7"}
    assert resp.output_text == chat.choices[0].message.content
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)
    assert resp.usage.total_tokens == chat.usage.total_tokens and resp.instructions == SYSTEM
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"


def test_the_stream_tells_the_same_answer_in_order(client):
    kwargs = dict(model="tiny", input=ASK, instructions=SYSTEM, max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text == events[-4].text
    assert whole.status == events[-1].response.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens" and events[-1].response.usage.output_tokens == 12
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema_is_followed(client, stream):
    schema = {"type": "object", "required": ["size", "n"], "properties": {
        "size": {"enum": ["small", "large"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    fmt = {"format": {"type": "json_schema", "name": "cache", "schema": schema, "strict": True}}
    resp = client.responses.create(model="tiny", input=ASK, text=fmt, max_output_tokens=100, stream=stream)
    if stream:
        resp = [e for e in resp if e.type == "response.completed"][0].response
    text = resp.output_text
    jsonschema.validate(json.loads(text), schema)


def test_earlier_output_sent_back_as_input(client):
    first = client.responses.create(model="tiny", input=ASK, max_output_tokens=5, temperature=0)
    history = [{"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": [{"type": "input_text", "text": "And then?"}]}]
    second = client.responses.create(model="tiny", input=history, max_output_tokens=5, temperature=0)
    chat = client.chat.completions.create(model="tiny", max_tokens=5, temperature=0, messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("body, param", [
    ({"background": True, "store": False}, "background"),
    ({"background": True, "stream": True}, "background"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}}, "text.format"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
])
def test_what_cannot_be_served_is_a_400_naming_it(server, body, param):
    resp = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", "input": ASK} | body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_thinking_becomes_a_reasoning_item(tiny_models, tmp_path):
    """A template that opens <think> at the end of the prompt: the (random) output is all reasoning."""
    template = QWEN3_LIKE.replace("{% elif force_thinking is defined and force_thinking %}", "{% else %}")
    srv = Server(with_chat_template(tiny_models["qwen3"], tmp_path / "thinking", template),
                 "--reasoning-parser", "qwen3")
    try:
        client = srv.openai_client()
        kwargs = dict(model="tiny", input=ASK, max_output_tokens=8, temperature=0)
        whole = client.responses.create(**kwargs)
        reasoning, message = whole.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text and message.content[0].text == ""
        events = list(client.responses.create(**kwargs, stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == reasoning.content[0].text and events[-1].response.output[0].content[0].text == deltas
    finally:
        assert srv.stop() == 0


def test_the_store_is_bounded_and_the_socket_needs_the_key(tiny_models):
    """--max-stored-responses: past it the least recently used response is dropped (404, as an unknown id).
    With --api-key the WebSocket mode needs the key too (its handshake is refused without it)."""
    srv = Server(tiny_models["qwen3"], "--max-stored-responses", "2", api_key="sekret")
    try:
        client = srv.openai_client(api_key="sekret")
        ids = [client.responses.create(model="tiny", input=f"turn {i}", max_output_tokens=2).id for i in range(3)]
        client.responses.retrieve(ids[1])  # used: now the most recent
        client.responses.create(model="tiny", input="turn 3", max_output_tokens=2)
        for gone in (ids[0], ids[2]):
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(gone)
        assert client.responses.retrieve(ids[1]).id == ids[1]
        url = srv.url.replace("http", "ws") + "/v1/responses"
        with pytest.raises(InvalidStatus):
            connect(url).close()
        with connect(url, additional_headers={"Authorization": "Bearer sekret"}) as socket:
            socket.send(json.dumps({"type": "response.create", "input": "Hi", "generate": False}))
            assert json.loads(socket.recv())["type"] == "response.created"
    finally:
        assert srv.stop() == 0
