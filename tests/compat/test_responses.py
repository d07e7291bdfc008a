"""POST /v1/responses with the real `openai` client: the plain text in and out (the chat completion of the same
conversation, the events of its stream in order, incomplete answers, structured output, earlier outputs sent back
as input, reasoning items, what is refused), then what SGLang's TestOpenAIServerv1Responses and vLLM's
Responses tests send and read."""

from __future__ import annotations

import itertools
import json
import time

import jsonschema
import openai
import pytest
from server_fixtures import Server, pages_all_free
from template_models import QWEN3_LIKE, with_chat_template
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

ASK = "Tell me about caches."
SYSTEM = "You are terse."
TOOL = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}


def test_a_response_is_the_chat_completion_of_the_same_conversation(client):
    resp = client.responses.create(model="demo", input=ASK, instructions=SYSTEM, max_output_tokens=200,
                                   temperature=0, metadata={"run": "7"})
    chat = client.chat.completions.create(model="demo", max_tokens=200, temperature=0, messages=[
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
    kwargs = dict(model="demo", input=ASK, instructions=SYSTEM, max_output_tokens=12, temperature=0)
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
    resp = client.responses.create(model="demo", input=ASK, text=fmt, max_output_tokens=100, stream=stream)
    if stream:
        resp = [e for e in resp if e.type == "response.completed"][0].response
    text = resp.output_text
    jsonschema.validate(json.loads(text), schema)


def test_earlier_output_sent_back_as_input(client):
    first = client.responses.create(model="demo", input=ASK, max_output_tokens=5, temperature=0)
    history = [{"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": [{"type": "input_text", "text": "And then?"}]}]
    second = client.responses.create(model="demo", input=history, max_output_tokens=5, temperature=0)
    chat = client.chat.completions.create(model="demo", max_tokens=5, temperature=0, messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("body, param", [
    ({"background": True, "stream": True}, "background"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}}, "text.format"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
])
def test_what_cannot_be_served_is_a_400_naming_it(http, body, param):
    resp = http.post("/v1/responses", json={"model": "demo", "input": ASK} | body)
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


# ---------------------------------------------------------------- SGLang's and vLLM's tests


def test_sglang_request_fields_are_served(client):
    """SGLang run_response: parallel_tool_calls, tool_choice auto and truncation disabled (without tools,
    a plain answer) come back on the response; tool_choice required without tools is a 400 naming it."""
    args = dict(model="demo", input="The capital of France is", max_output_tokens=8, temperature=0)
    plain = client.responses.create(**args)
    told = client.responses.create(**args, parallel_tool_calls=True, tool_choice="auto", truncation="disabled")
    assert told.output_text == plain.output_text
    assert (told.tool_choice, told.parallel_tool_calls, told.truncation) == ("auto", True, "disabled")
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**args, tool_choice="required")
    assert caught.value.body["param"] == "tool_choice"


def test_penalties_and_sglangs_usage_names(http):
    """SGLang test_penalty: frequency_penalty is served on /v1/responses, and the usage has SGLang's
    prompt_tokens / completion_tokens beside OpenAI's input_tokens / output_tokens."""
    body = {"model": "demo", "input": "Introduce the capital of France.", "temperature": 0, "max_output_tokens": 32}
    plain = http.post("/v1/responses", json=body).json()
    penalized = http.post("/v1/responses", json=body | {"frequency_penalty": 2.0})
    assert penalized.status_code == 200, penalized.text
    usage = penalized.json()["usage"]
    assert usage["prompt_tokens"] == usage["input_tokens"] == plain["usage"]["input_tokens"]
    assert usage["completion_tokens"] == usage["output_tokens"] and usage["total_tokens"] == (
        usage["prompt_tokens"] + usage["completion_tokens"])
    assert penalized.json()["output"][0]["content"][0]["text"] != plain["output"][0]["content"][0]["text"]


def test_unknown_previous_response_id_is_a_400_with_a_code(http):
    """SGLang test_error: a previous_response_id no stored response has is a 400 whose error has message,
    type and code (OpenAI's previous_response_not_found)."""
    answer = http.post("/v1/responses", json={"model": "demo", "input": "Hi", "previous_response_id": "bad"})
    assert answer.status_code == 400 and {"message", "type", "code"} <= answer.json()["error"].keys()
    assert answer.json()["error"]["code"] == "previous_response_not_found"


def test_vllm_sampling_extras_and_reasoning_effort(client):
    """vLLM test_extra_sampling_params and test_max_tokens: top_k, repetition_penalty and seed are served; a
    reasoning effort is accepted; an answer cut by max_output_tokens is incomplete, saying why."""
    args = dict(model="demo", input="Write a short sentence", max_output_tokens=30, temperature=0.7, top_p=0.9)
    extras = {"top_k": 40, "repetition_penalty": 1.2, "seed": 42}
    first = client.responses.create(**args, extra_body=extras)
    assert first.output_text == client.responses.create(**args, extra_body=extras).output_text  # seeded
    greedy = dict(model="demo", input="Write a short sentence", temperature=0)
    assert client.responses.create(**greedy, max_output_tokens=50).usage.output_tokens > 3  # it goes on past 3
    cut = client.responses.create(**greedy, max_output_tokens=3, reasoning={"effort": "low"})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools(client, stream):
    """SGLang test_responses_function_calling: function tools in the Responses API's flat form. A forced call
    is a function_call output item (streamed: added, its arguments, done); tool_choice none gives a plain
    message and no call."""
    args = dict(model="demo", input="What time is it in Paris?", tools=[TOOL], max_output_tokens=40)
    forced = {"type": "function", "name": "get_time"}
    if stream:
        events = list(client.responses.create(**args, tool_choice=forced, stream=True))
        kinds = [e.type for e in events]
        assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.done")
        output = events[-1].response.output
    else:
        output = client.responses.create(**args, tool_choice=forced).output
    [call] = [item for item in output if item.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET") and call.call_id
    plain = client.responses.create(**args, tool_choice="none")
    assert [item.type for item in plain.output] == ["message"]


# ---------------------------------------------------------------- the store (vLLM's test_stateful.py)


def test_responses_are_stored_unless_store_is_false(client, http):
    """vLLM test_store: store defaults to true and GET /v1/responses/{id} returns the response; with
    store: false it is not kept (404 "Response with id ... not found."); DELETE forgets a stored one."""
    kept = client.responses.create(input="Hello!", max_output_tokens=4)
    assert kept.store is True
    again = client.responses.retrieve(kept.id)
    assert (again.id, again.output_text, again.usage.output_tokens) == (kept.id, kept.output_text, 4)
    unkept = client.responses.create(input="Hello!", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError, match="Response with id .* not found."):
        client.responses.retrieve(unkept.id)
    assert http.delete(f"/v1/responses/{kept.id}").json() == {"id": kept.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    assert http.delete(f"/v1/responses/{kept.id}").status_code == 404


def test_a_streamed_response_is_stored_as_it_ended(client):
    """vLLM test_store, streamed: the response the last event carries is the one stored."""
    last = list(client.responses.create(input="Hello!", max_output_tokens=4, stream=True))[-1].response
    stored = client.responses.retrieve(last.id)
    assert (stored.status, stored.output_text) == (last.status, last.output_text)


def test_background_needs_store(client):
    """vLLM test_background_error: background with store false is a 400 saying so, naming background."""
    with pytest.raises(openai.BadRequestError, match="background can only be used when `store` is true") as caught:
        client.responses.create(input="What is 13 * 24?", background=True, store=False)
    assert caught.value.body["param"] == "background"


def test_a_background_response_is_queued_then_stored_whole(client):
    """vLLM test_background: the answer is at once `queued`; polled, the response ends as a foreground one
    would have (same text at temperature 0)."""
    args = dict(input="Hello!", max_output_tokens=6, temperature=0)
    queued = client.responses.create(**args, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    while (polled := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        time.sleep(0.05)
    assert polled.output_text == client.responses.create(**args).output_text and polled.status == "incomplete"


def wait_until_nothing_runs(demo) -> None:
    """No sequence left and every KV page free (cached ones evictable); the scheduler frees them on its next
    step, so this waits for it (30 s at most: a generation left running would take minutes)."""
    deadline = time.monotonic() + 30
    while not pages_all_free(demo.info()):
        assert time.monotonic() < deadline, demo.info()["scheduler"]
        time.sleep(0.05)


def test_cancelling_a_background_response_stops_its_generation(client, demo):
    """vLLM test_background_cancel: cancel answers `cancelled`, the status stays so, and the generation is
    aborted: no sequence runs and every KV page is free again (cached pages are evictable). Greedy, the demo
    model's answer to this prompt runs to the context's end (sampled, it may stop after a few tokens)."""
    queued = client.responses.create(input="Write a long story about a cat.", background=True, temperature=0)
    while client.responses.retrieve(queued.id).status == "queued":
        time.sleep(0.05)
    assert client.responses.cancel(queued.id).status == "cancelled"
    wait_until_nothing_runs(demo)
    stopped = client.responses.retrieve(queued.id)
    assert stopped.status == "cancelled" and stopped.output == []
    assert client.responses.cancel(queued.id).status == "cancelled"  # cancelling again changes nothing


def test_a_foreground_response_cannot_be_cancelled(client):
    """vLLM test_cancel_completed: cancelling a synchronous response is a 400 saying so; an unknown id 404."""
    done = client.responses.create(input="Hello", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        client.responses.cancel(done.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def chat_of(client, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(model="demo", messages=messages, max_tokens=max_tokens, temperature=0)


def test_previous_response_id_continues_its_conversation(client):
    """vLLM test_previous_response_id: a response continuing a stored one is the chat completion of the
    whole conversation (its instructions are not carried over, as OpenAI has it); the model may be left out,
    as vLLM's tests do."""
    first = client.responses.create(instructions="You are terse.", input="Hello, my name is John.",
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, max_output_tokens=6,
                                     temperature=0)
    chat = chat_of(client, [{"role": "user", "content": "Hello, my name is John."},
                            {"role": "assistant", "content": first.output_text},
                            {"role": "user", "content": "What is my name?"}], 6)
    assert second.previous_response_id == first.id
    assert (second.output_text, second.usage.input_tokens) == (chat.choices[0].message.content,
                                                               chat.usage.prompt_tokens)


def test_two_responses_may_continue_the_same_one(client):
    """vLLM test_two_responses_with_same_prev_id: a stored response is not changed by being continued; two
    continuations of it see the same conversation."""
    first = client.responses.create(input="Hello, my name is John.", max_output_tokens=6, temperature=0)
    forks = [client.responses.create(input=text, previous_response_id=first.id, max_output_tokens=6, temperature=0)
             for text in ("My name is Mark.", "My name is Mark.", "What is my name?")]
    assert forks[0].output_text == forks[1].output_text
    assert forks[0].usage.input_tokens == forks[1].usage.input_tokens
    chat = chat_of(client, [{"role": "user", "content": "Hello, my name is John."},
                            {"role": "assistant", "content": first.output_text},
                            {"role": "user", "content": "What is my name?"}], 6)
    assert forks[2].output_text == chat.choices[0].message.content


def test_input_items_list_the_requests_own_input(client):
    """OpenAI's GET /v1/responses/{id}/input_items: the response's own input (not the conversation before
    it), newest first unless order=asc, a page of `limit` after the `after` id."""
    first = client.responses.create(input="one", max_output_tokens=2)
    second = client.responses.create(previous_response_id=first.id, max_output_tokens=2, input=[
        {"role": "user", "content": "two"}, {"role": "user", "content": [{"type": "input_text", "text": "three"}]}])
    newest_first = client.responses.input_items.list(second.id)
    assert [item.content[0].text for item in newest_first.data] == ["three", "two"]
    oldest_first = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert [item.content[0].text for item in oldest_first.data] == ["two"] and oldest_first.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=oldest_first.data[0].id)
    assert [item.content[0].text for item in rest.data] == ["three"] and not rest.has_more
    assert [item.content[0].text for item in client.responses.input_items.list(first.id).data] == ["one"]


FUNCTION = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
CALL = {"type": "function_call", **FUNCTION}


def calls(*ids: str) -> dict:
    return {"role": "assistant", "tool_calls": [{"id": i, "type": "function", "function": FUNCTION} for i in ids]}


def result(call_id: str, text: str) -> tuple[dict, dict]:
    """A call's result as a function_call_output item and as the tool message it stands for."""
    return ({"type": "function_call_output", "call_id": call_id, "output": text},
            {"role": "tool", "tool_call_id": call_id, "content": text})


SUNNY, RAIN = result("c1", "sunny"), result("c2", "rain")


@pytest.mark.parametrize("items, messages", [
    ([CALL | {"call_id": "c1"}, CALL | {"call_id": "c2"}, SUNNY[0], RAIN[0]], [calls("c1", "c2"), SUNNY[1], RAIN[1]]),
    ([CALL | {"call_id": "c1"}, SUNNY[0], CALL | {"call_id": "c2"}], [calls("c1"), SUNNY[1], calls("c2")]),
], ids=["parallel-calls", "call-result-call"])
def test_function_calls_sent_back_are_assistant_turns(client, items, messages):
    """vLLM test_consecutive_function_call_merge and test_named_tool_use's second turn: function_call items
    sent back are an assistant turn's tool calls (consecutive ones one turn), function_call_output items tool
    turns: the response is the chat completion of those messages."""
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    resp = client.responses.create(input=[ask, *items], max_output_tokens=6, temperature=0)
    chat = chat_of(client, [ask, *messages], 6)
    assert (resp.output_text, resp.usage.input_tokens) == (chat.choices[0].message.content, chat.usage.prompt_tokens)


# ---------------------------------------------------------------- WebSocket mode (vLLM's test_websocket_real.py)


def turn(socket, **create) -> list[dict]:
    """Send a response.create and read its events up to the last (an error is the only one then)."""
    socket.send(json.dumps({"type": "response.create", **create}))
    events = [json.loads(socket.recv())]
    while events[-1]["type"] not in ("response.completed", "response.incomplete", "response.failed", "error"):
        events.append(json.loads(socket.recv()))
    return events


def event_runs(types) -> list[str]:
    """Event types with each run of one type counted once."""
    return [kind for kind, _ in itertools.groupby(types)]


def test_websocket_mode_streams_the_same_events(client, demo):
    """vLLM test_basic_streaming / test_streaming_event_ordering / test_response_has_usage: a response.create
    on the socket gets the events `stream: true` gets (ending with response.incomplete when cut, as OpenAI
    has it), the same answer, with usage. How many text deltas carry it depends on how far each reader lags
    (a reader behind the engine gets its tokens merged into one delta), so runs of deltas compare as one."""
    args = dict(model="demo", input="Hello", max_output_tokens=8, temperature=0)
    with connect(demo.url.replace("http", "ws") + "/v1/responses") as socket:
        events = turn(socket, **args)
    streamed = list(client.responses.create(**args, stream=True))
    assert event_runs(event["type"] for event in events) == event_runs(event.type for event in streamed)
    deltas = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert deltas == "".join(event.delta for event in streamed if event.type == "response.output_text.delta")
    last = events[-1]["response"]
    assert last["status"] == "incomplete" and last["usage"]["output_tokens"] == 8
    assert last["output"][0]["content"][0]["text"] == client.responses.create(**args).output_text


def test_websocket_mode_warm_up_and_continuation(client, demo):
    """vLLM test_warmup_generate_false, test_warmup_then_real_request, test_continuation_with_previous_response_id:
    generate: false is created + completed with no output; a turn continues the connection's last response
    (even with store: false, which keeps it from GET) as the chat completion of the whole conversation."""
    with connect(demo.url.replace("http", "ws") + "/v1/responses") as socket:
        warm = turn(socket, input="Hello, my name is John.", generate=False, store=False)
        assert [event["type"] for event in warm] == ["response.created", "response.completed"]
        assert warm[-1]["response"]["output"] == [] and warm[-1]["response"]["status"] == "completed"
        first = turn(socket, input="What is my name?", previous_response_id=warm[-1]["response"]["id"],
                     max_output_tokens=6, temperature=0, store=False)[-1]["response"]
        second = turn(socket, input="Again?", previous_response_id=first["id"], max_output_tokens=6,
                      temperature=0)[-1]["response"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first["id"])
    assert client.responses.retrieve(second["id"]).previous_response_id == first["id"]
    answer = first["output"][0]["content"][0]["text"]
    chat = chat_of(client, [{"role": "user", "content": "Hello, my name is John."},
                            {"role": "user", "content": "What is my name?"},
                            {"role": "assistant", "content": answer}, {"role": "user", "content": "Again?"}], 6)
    assert second["output"][0]["content"][0]["text"] == chat.choices[0].message.content
    assert second["usage"]["input_tokens"] == chat.usage.prompt_tokens


def test_websocket_mode_errors_keep_the_connection(demo):
    """vLLM test_invalid_json, test_unknown_event_type, test_invalid_previous_response_id: each is an `error`
    event with its code and the connection serves the next turn (previous_response_not_found is a 400, as on
    HTTP and OpenAI's; vLLM says 404)."""
    with connect(demo.url.replace("http", "ws") + "/v1/responses") as socket:
        socket.send("this is not json{{{")
        assert json.loads(socket.recv())["error"]["code"] == "invalid_json"
        socket.send(json.dumps({"type": "session.update"}))
        assert json.loads(socket.recv())["error"]["code"] == "unknown_event_type"
        [missing] = turn(socket, input="Hi", previous_response_id="resp_nonexistent")
        assert (missing["status"], missing["error"]["code"]) == (400, "previous_response_not_found")
        [refused] = turn(socket, input="Hi", stream=True)
        assert (refused["status"], refused["error"]["param"]) == (400, "stream")
        [unknown] = turn(socket, input="Hi", colour="red")
        assert (unknown["status"], unknown["error"]["param"]) == (400, "colour")
        [not_bool] = turn(socket, input="Hi", generate="no")
        assert (not_bool["status"], not_bool["error"]["param"]) == (400, "generate")
        assert turn(socket, input="Hi", max_output_tokens=2)[-1]["type"] == "response.incomplete"


def test_a_socket_closed_mid_turn_stops_its_generation(demo):
    """A client that hangs up during a turn leaves nothing running: the generation is aborted and its KV
    pages are free again (as for an HTTP stream the client leaves). Greedy, so the turn runs long (see above)."""
    with connect(demo.url.replace("http", "ws") + "/v1/responses") as socket:
        socket.send(json.dumps({"type": "response.create", "input": "Write a long story about a cat.",
                                "temperature": 0}))
        while json.loads(socket.recv())["type"] != "response.output_text.delta":
            pass
    wait_until_nothing_runs(demo)


def test_orca_load_report_on_responses(client):
    """vLLM's ORCA load report (`endpoint-load-metrics-format: JSON`) is answered on /v1/responses as on every
    other generation route: it runs on the same pipeline; streamed too."""
    asked = {"endpoint-load-metrics-format": "JSON"}
    args = dict(model="demo", input="Hi", max_output_tokens=2)
    whole = client.responses.with_raw_response.create(**args, extra_headers=asked).headers
    assert whole["endpoint-load-metrics"].startswith("JSON ")
    with client.responses.with_streaming_response.create(**args, stream=True, extra_headers=asked) as streamed:
        assert streamed.headers["endpoint-load-metrics"].startswith("JSON ")
        assert streamed.read()
    assert "endpoint-load-metrics" not in client.responses.with_raw_response.create(**args).headers


def test_include_output_logprobs_whole_and_streamed(client, http):
    """The Agents SDK sends `include` on every call: message.output_text.logprobs is served (each output token's
    logprob and top_logprobs alternatives, as chat's logprobs give them), the values naming outputs this server
    never makes are taken with nothing to add (as vLLM takes them), top_logprobs alone is a 400 naming it."""
    args = dict(model="demo", input="The capital of France is", max_output_tokens=5, temperature=0)
    whole = client.responses.create(**args, include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = whole.output[-1].content[0].logprobs
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": args["input"]}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    expected = chat.choices[0].logprobs.content
    assert [lp.token for lp in logprobs] == [c.token for c in expected]
    assert [lp.logprob for lp in logprobs] == pytest.approx([c.logprob for c in expected], abs=1e-3)
    assert len(logprobs) == whole.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    events = list(client.responses.create(**args, include=["message.output_text.logprobs"], top_logprobs=2,
                                          stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in streamed] == [lp.token for lp in done.logprobs] == [lp.token for lp in logprobs]
    others = client.responses.create(**args, include=["reasoning.encrypted_content", "file_search_call.results"])
    assert others.output_text == whole.output_text and others.output[-1].content[0].logprobs == []
    refused = http.post("/v1/responses", json=args | {"top_logprobs": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
    unknown = http.post("/v1/responses", json=args | {"include": ["no.such.thing"]})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "include"


def test_a_forced_call_with_a_text_format(client):
    """instructor's RESPONSES_TOOLS: a forced tool choice together with text.format json_schema is taken (as
    OpenAI and vLLM take it): the forced call decides the turn's output, the format is for text answers."""
    schema = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
    resp = client.responses.create(model="demo", input="What time is it?", max_output_tokens=40, tools=[TOOL],
                                   tool_choice={"type": "function", "name": "get_time"},
                                   text={"format": {"type": "json_schema", "name": "Time", "schema": schema}})
    calls = [item for item in resp.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_time"] and json.loads(calls[0].arguments)["zone"] in ("UTC", "CET")
