"""POST /v1/responses: what SGLang's TestOpenAIServerv1Responses and vLLM's Responses tests send and read,
beyond the plain text in and out, with the real `openai` client."""

from __future__ import annotations

import json

import openai
import pytest

TOOL = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}


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


def test_previous_response_id_is_a_400_with_a_code(http):
    """SGLang test_error: a previous_response_id (nothing is stored here) is a 400 whose error has message,
    type and code."""
    answer = http.post("/v1/responses", json={"model": "demo", "input": "Hi", "previous_response_id": "bad"})
    assert answer.status_code == 400 and {"message", "type", "code"} <= answer.json()["error"].keys()


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
