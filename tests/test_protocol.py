"""The OpenAI protocol layer: request parsing, conversion to SamplingParams, response shapes."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from minisgl.core import SamplingParams
from minisgl.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ProtocolError,
    Usage,
    chat_logprobs,
    completion_logprobs,
    error_body,
    stop_strings,
    to_sampling_params,
)

LIMIT = 1000


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields
    return ChatCompletionRequest.model_validate(body)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi"} | fields)


# ---------------------------------------------------------------- parsing


def test_chat_string_and_text_parts():
    req = chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ])
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert [m.text() for m in req.messages] == ["be brief", "ab", "", "42"]
    assert req.messages[3].tool_call_id == "call_1"


def test_chat_image_part_rejected():
    req = chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
    ]}])
    with pytest.raises(ProtocolError) as e:
        req.messages[0].text()
    assert e.value.param == "messages"
    assert "only text content parts" in e.value.message


def test_chat_validation_errors():
    with pytest.raises(ValidationError):
        chat(messages=[])
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})  # no model


def test_unknown_fields_ignored():
    req = chat(logit_bias={"1": 5}, tools=[], parallel_tool_calls=True)
    assert not hasattr(req, "logit_bias")
    assert completion(suffix="x").prompts() == ["hi"]


@pytest.mark.parametrize("prompt, expected", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_shapes(prompt, expected):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", ["", [], ["a", ""], [[1], []]])
def test_empty_prompt(prompt):
    with pytest.raises(ProtocolError) as e:
        completion(prompt=prompt).prompts()
    assert e.value.param == "prompt"


def test_completion_defaults():
    req = completion()
    assert req.max_tokens == 16 and req.logprobs is None and req.echo is False and req.n == 1


# ---------------------------------------------------------------- to_sampling_params


def test_defaults():
    p = to_sampling_params(chat(), LIMIT)
    assert p == SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, max_tokens=LIMIT,
                               presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    assert p.logprobs is None
    assert to_sampling_params(completion(), LIMIT).max_tokens == 16


def test_fields_pass_through():
    p = to_sampling_params(chat(temperature=0, top_p=0.5, top_k=20, min_p=0.1, seed=7, min_tokens=3,
                                stop_token_ids=[5, 6], ignore_eos=True, presence_penalty=0.5,
                                frequency_penalty=-0.5, repetition_penalty=1.2, max_tokens=50), LIMIT)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0, 0.5, 20, 0.1, 7)
    assert (p.min_tokens, p.max_tokens, p.stop_token_ids, p.ignore_eos) == (3, 50, [5, 6], True)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)


def test_max_tokens_choice_and_clamp():
    assert to_sampling_params(chat(max_tokens=10, max_completion_tokens=20), LIMIT).max_tokens == 20
    assert to_sampling_params(chat(max_tokens=10), LIMIT).max_tokens == 10
    assert to_sampling_params(chat(max_completion_tokens=5000), LIMIT).max_tokens == LIMIT
    assert to_sampling_params(completion(max_tokens=5000), 100).max_tokens == 100
    p = to_sampling_params(completion(max_tokens=500, min_tokens=400), 100)
    assert (p.max_tokens, p.min_tokens) == (100, 100)


def test_prompt_fills_context():
    with pytest.raises(ProtocolError) as e:
        to_sampling_params(chat(), 0)
    assert e.value.param == "messages"
    with pytest.raises(ProtocolError) as e:
        to_sampling_params(completion(), 0)
    assert e.value.param == "prompt"


def test_logprobs():
    assert to_sampling_params(chat(logprobs=True), LIMIT).logprobs == 0
    assert to_sampling_params(chat(logprobs=True, top_logprobs=5), LIMIT).logprobs == 5
    assert to_sampling_params(completion(logprobs=20), LIMIT).logprobs == 20
    assert to_sampling_params(completion(logprobs=0), LIMIT).logprobs == 0


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
])
def test_chat_invalid(fields, param):
    with pytest.raises(ProtocolError) as e:
        to_sampling_params(chat(**fields), LIMIT)
    assert e.value.param == param
    assert param in e.value.message


@pytest.mark.parametrize("fields, param", [
    ({"logprobs": 21}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"n": 17}, "n"),
])
def test_completion_invalid(fields, param):
    with pytest.raises(ProtocolError) as e:
        to_sampling_params(completion(**fields), LIMIT)
    assert e.value.param == param


def test_stop_strings():
    assert stop_strings(chat()) == []
    assert stop_strings(chat(stop="\n")) == ["\n"]
    assert stop_strings(completion(stop=["a", "b"])) == ["a", "b"]


# ---------------------------------------------------------------- responses


def usage(cached: int = 0) -> Usage:
    return Usage(prompt_tokens=7, completion_tokens=3, prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def test_usage():
    assert usage(4).model_dump() == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                     "prompt_tokens_details": {"cached_tokens": 4}}


def test_chat_response_shape():
    resp = ChatCompletionResponse(model="m", usage=usage(), choices=[
        ChatChoice(index=0, message=ChatResponseMessage(content="hello"), finish_reason="stop")])
    body = json.loads(resp.model_dump_json())
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["total_tokens"] == 10
    assert ChatCompletionResponse(model="m", usage=usage(), choices=[]).id != resp.id


def test_chat_chunk_shape():
    first = ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[
        ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
    body = first.model_dump()
    assert body["object"] == "chat.completion.chunk" and body["id"] == "chatcmpl-1"
    assert body["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}]
    assert body["usage"] is None
    later = ChatChunkChoice(index=0, delta=DeltaMessage(content="lo"), finish_reason="length")
    assert later.model_dump()["delta"] == {"content": "lo"}
    assert ChatChunkChoice(index=0, delta=DeltaMessage()).model_dump()["delta"] == {}
    final = ChatCompletionChunk(model="m", choices=[], usage=usage())
    assert final.model_dump(exclude_none=True)["usage"]["total_tokens"] == 10


def test_completion_shapes():
    resp = CompletionResponse(model="m", usage=usage(), choices=[
        CompletionChoice(index=0, text="abc", finish_reason="length")])
    body = json.loads(resp.model_dump_json())
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}]
    chunk = CompletionChunk(model="m", choices=[CompletionChoice(index=0, text="a")]).model_dump(exclude_none=True)
    assert chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 0, "text": "a"}] and "usage" not in chunk


def test_models_and_errors():
    body = ModelList(data=[ModelCard(id="qwen", max_model_len=4096)]).model_dump()
    assert body["object"] == "list"
    card = body["data"][0]
    assert set(card) == {"id", "object", "created", "owned_by", "max_model_len"}
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == ("qwen", "model", "minisgl", 4096)

    assert error_body("bad n", "invalid_request_error", "n", 400) == {
        "error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": 400}}
    assert error_body("oops")["error"] == {"message": "oops", "type": "invalid_request_error",
                                           "param": None, "code": None}


# ---------------------------------------------------------------- logprobs payloads


def test_chat_logprobs():
    out = chat_logprobs([("Hé", -0.5, [("Hé", -0.5), ("H", -1.5)]), (" x", -0.1, [])])
    assert out == {"content": [
        {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169], "top_logprobs": [
            {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]},
            {"token": "H", "logprob": -1.5, "bytes": [72]}]},
        {"token": " x", "logprob": -0.1, "bytes": [32, 120], "top_logprobs": []},
    ]}
    assert chat_logprobs([]) == {"content": []}


def test_completion_logprobs():
    out = completion_logprobs([("ab", -0.5, [("ab", -0.5), ("a", -2.0)]), ("c", -0.25, [("c", -0.25)])],
                              text_offset_start=3)
    assert out == {"tokens": ["ab", "c"], "token_logprobs": [-0.5, -0.25],
                   "top_logprobs": [{"ab": -0.5, "a": -2.0}, {"c": -0.25}], "text_offset": [3, 5]}


def test_logprobs_stay_json_encodable():
    out = chat_logprobs([("a", -0.5, [("b", float("-inf"))])])
    json.dumps(out, allow_nan=False)
    assert out["content"][0]["top_logprobs"][0]["logprob"] == -9999.0
    json.dumps(completion_logprobs([("a", float("-inf"), [])]), allow_nan=False)
