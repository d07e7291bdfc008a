"""The wire formats: request parsing (strict types, ranges, text) and response shapes."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from minisgl.messages import Alternative, LogprobEntry
from minisgl.server.errors import ApiError, field_path
from minisgl.server.routes.chat import chat_prompt
from minisgl.server.routes.models import ModelCard, ModelList
from minisgl.server.schemas.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    DeltaMessage,
)
from minisgl.server.schemas.completions import (
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
    CompletionResponse,
)
from minisgl.server.schemas.logprobs import chat_logprobs, completion_logprobs
from minisgl.server.schemas.tokenize import DetokenizeRequest
from minisgl.server.schemas.types import PromptTokensDetails, Usage


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields
    return ChatCompletionRequest.model_validate(body)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi"} | fields)


def refused_field(make, **fields) -> str:
    """The request field a schema error names (as the server's 400 `param` does)."""
    with pytest.raises(ValidationError) as e:
        make(**fields)
    return field_path(e.value.errors()[0]["loc"])[0]


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


def test_chat_image_part_refused_by_name():
    with pytest.raises(ValidationError) as e:
        chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    error = e.value.errors()[0]
    assert field_path(error["loc"])[0] == "messages" and "only text content parts" in error["msg"]
    assert "image_url" in error["msg"]


def test_chat_schema_errors_name_the_field():
    with pytest.raises(ApiError) as empty:  # the schema lets it through for vLLM's prompt_token_ids
        body = chat(messages=[])
        chat_prompt(body, None, body.messages)
    assert empty.value.param == "messages"
    assert refused_field(chat, messages=[{"role": "", "content": "x"}]) == "messages"
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": None, "messages": [{"role": "user", "content": "x"}]})
    assert field_path(e.value.errors()[0]["loc"]) == ["model"]
    # Left out, it is the served model (vLLM and SGLang accept that; the route decides which).
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}).model is None


def test_unknown_fields_are_refused_by_name():
    assert refused_field(chat, service_tier="auto") == "service_tier"
    assert refused_field(completion, suffix="x") == "suffix"
    assert refused_field(chat, messages=[{"role": "user", "content": "hi", "extra_field": "0"}]) == "messages"
    assert refused_field(chat, stream_options={"include_usage": True, "include_obfuscation": False}) == \
        "stream_options"


@pytest.mark.parametrize("prompt, expected", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_shapes(prompt, expected):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", ["", [], ["a", ""], [[1], []], [1, -2], [[1, 2], ["a"]], {"a": 1}, None,
                                    # past the plain-ids fast path (types.PlainIdsFirst): one bad id late in a list
                                    [*range(1000), True], [*range(1000), -1], [*range(1000), "7"], [[1], [2, True]],
                                    [[1, 2], 3], [[]], [[1], [2, None]]])
def test_bad_prompts_are_refused_naming_prompt(prompt):
    assert refused_field(completion, prompt=prompt) == "prompt"


def test_completion_defaults():
    req = completion()
    assert req.max_tokens is None and req.DEFAULT_MAX_TOKENS == 16  # 16 when left out, lowered to the room left
    assert req.logprobs is None and req.echo is False and req.n == 1


# ---------------------------------------------------------------- strict types (as OpenAI: no coercion)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", True), ("max_tokens", "3"), ("max_tokens", 3.5), ("n", "1"), ("n", True), ("temperature", "0.5"),
    ("temperature", True), ("stream", "no"), ("stream", 0), ("ignore_eos", 1), ("seed", "7"), ("top_k", 2.5),
    ("stop_token_ids", [1, True]), ("stop_token_ids", ["1"]), ("logit_bias", {"1": "5"}), ("echo", 0),
    ("temperature", float("nan")), ("top_p", float("inf")), ("user", 5), ("stop", 3),
])
def test_wrong_types_are_refused_not_coerced(field, value):
    assert refused_field(completion, **{field: value}) == field


def test_integral_numbers_count_as_integers():
    # JSON Schema calls 3.0 an integer (clients generated from openapi.json may send it)
    req = completion(prompt=[1.0, 2], max_tokens=3.0, n=2.0)
    assert req.prompt == [1, 2] and req.max_tokens == 3 and req.n == 2
    assert all(type(x) is int for x in req.prompt)
    batch = completion(prompt=[[1, 2], [*range(100), 3.0]]).prompt  # a float past the fast path's first row
    assert batch == [[1, 2], [*range(100), 3]] and all(type(x) is int for row in batch for x in row)


@pytest.mark.parametrize("make, fields, field", [
    (chat, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    (chat, {"model": "a\udfffb"}, "model"),
    (chat, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, "messages"),
    (completion, {"prompt": "x\ud800"}, "prompt"),
    (completion, {"prompt": ["ok", "\ud800"]}, "prompt"),
    (completion, {"stop": ["\ud800"]}, "stop"),
    (completion, {"user": "\ud800"}, "user"),
])
def test_lone_surrogates_are_refused_naming_the_field(make, fields, field):
    assert refused_field(make, **fields) == field


@pytest.mark.parametrize("make, fields, param", [
    (chat, {"temperature": -1}, "temperature"),
    (chat, {"top_p": 0}, "top_p"),
    (chat, {"top_k": -2}, "top_k"),
    (chat, {"min_p": 2}, "min_p"),
    (chat, {"n": 0}, "n"),
    (chat, {"n": 17}, "n"),
    (chat, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (chat, {"presence_penalty": 3}, "presence_penalty"),
    (chat, {"frequency_penalty": -3}, "frequency_penalty"),
    (chat, {"repetition_penalty": 0}, "repetition_penalty"),
    (chat, {"max_tokens": 0}, "max_tokens"),
    (chat, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (chat, {"min_tokens": -1}, "min_tokens"),
    (chat, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (chat, {"stop": [f"s{i}" for i in range(17)]}, "stop"),
    (chat, {"stop": ""}, "stop"),
    (chat, {"stop": ["ok", ""]}, "stop"),
    (chat, {"logit_bias": {"1": 101}}, "logit_bias"),
    (chat, {"logit_bias": {"abc": 1}}, "logit_bias"),
    (chat, {"logit_bias": {"-1": 1}}, "logit_bias"),
    (completion, {"logprobs": -1}, "logprobs"),
    (completion, {"max_tokens": 0}, "max_tokens"),
    (completion, {"temperature": -1}, "temperature"),
])
def test_ranges_are_refused_naming_the_field(make, fields, param):
    assert refused_field(make, **fields) == param


def test_detokenize_ids_are_non_negative_integers():
    assert DetokenizeRequest.model_validate({"tokens": [0, 5.0]}).tokens == [0, 5]
    with pytest.raises(ValidationError):
        DetokenizeRequest.model_validate({"tokens": [-1]})


# ---------------------------------------------------------------- responses


def usage(cached: int = 0) -> Usage:
    return Usage(prompt_tokens=7, completion_tokens=3, prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def test_usage():
    assert usage(4).model_dump() == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                     "prompt_tokens_details": {"cached_tokens": 4},
                                     "cache_read_input_tokens": 4}  # vLLM's name for the cached tokens


def test_chat_response_shape():
    resp = ChatCompletionResponse(model="m", usage=usage(), choices=[
        ChatChoice(index=0, message=ChatResponseMessage(content="hello"), finish_reason="stop")])
    body = json.loads(resp.model_dump_json())
    assert list(body) == ["id", "object", "created", "model", "choices", "usage", "service_tier",
                          "system_fingerprint", "metadata", "moderation",  # OpenAI's, null here
                          "prompt_logprobs", "prompt_token_ids"]  # + vLLM's
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hello", "refusal": None,
                                                        "annotations": None, "audio": None, "function_call": None,
                                                        "tool_calls": None, "reasoning_content": None},
                                "logprobs": None, "finish_reason": "stop", "token_ids": None,  # + vLLM's
                                "matched_stop": None}]  # + SGLang's
    assert body["usage"]["total_tokens"] == 10
    assert ChatCompletionResponse(model="m", usage=usage(), choices=[]).id != resp.id


def test_chat_chunk_shape():
    first = ChatCompletionChunk(id="chatcmpl-1", model="m", choices=[
        ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
    body = first.model_dump()
    assert body["object"] == "chat.completion.chunk" and body["id"] == "chatcmpl-1"
    assert body["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": "", "reasoning_content": None},
                                "logprobs": None, "finish_reason": None}]
    assert body["usage"] is None
    later = ChatChunkChoice(index=0, delta=DeltaMessage(content="lo"), finish_reason="length")
    assert later.model_dump()["delta"] == {"content": "lo", "reasoning_content": None}
    assert ChatChunkChoice(index=0, delta=DeltaMessage()).model_dump()["delta"] == {"reasoning_content": None}
    final = ChatCompletionChunk(model="m", choices=[], usage=usage())
    assert final.model_dump(exclude_none=True)["usage"]["total_tokens"] == 10


def test_completion_shapes():
    resp = CompletionResponse(model="m", usage=usage(), choices=[
        CompletionChoice(index=0, text="abc", finish_reason="length")])
    body = json.loads(resp.model_dump_json())
    assert list(body) == ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length",
                                "token_ids": None, "prompt_token_ids": None, "prompt_logprobs": None,
                                "matched_stop": None}]  # + vLLM's and SGLang's
    ids_only = CompletionChoice(index=0, text="", token_ids=[5, 6], finish_reason="length").model_dump()
    assert ids_only["token_ids"] == [5, 6]
    chunk = CompletionChunk(model="m", choices=[CompletionChunkChoice(index=0, text="a")]).model_dump()
    assert chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None,
                                 "prompt_logprobs": None, "matched_stop": None}]  # ids only on chunks with some


def test_models_and_errors():
    body = ModelList(data=[ModelCard(id="qwen", root="qwen", max_model_len=4096)]).model_dump()
    assert body["object"] == "list"
    card = body["data"][0]
    assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"}
    assert (card["id"], card["object"], card["owned_by"], card["root"], card["parent"], card["max_model_len"]) == (
        "qwen", "model", "minisgl", "qwen", None, 4096)

    assert ApiError(400, "bad n", param="n", code="x").body() == {
        "error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": "x"}}
    assert ApiError(503, "busy").body()["error"]["type"] == "service_unavailable"
    assert ApiError(500, "oops").body()["error"] == {"message": "oops", "type": "server_error",
                                                     "param": None, "code": None}


# ---------------------------------------------------------------- logprobs payloads


def entry(text: str, token_id: int, logprob: float, top: list[tuple[str, float, int]]) -> LogprobEntry:
    return LogprobEntry(text, token_id, logprob, [Alternative(*alt) for alt in top])


def test_chat_logprobs():
    out = chat_logprobs([entry("Hé", 7, -0.5, [("Hé", -0.5, 7), ("H", -1.5, 3)]),
                         entry(" x", 9, -0.1, [])]).model_dump()
    assert out == {"content": [
        {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169], "top_logprobs": [
            {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]},
            {"token": "H", "logprob": -1.5, "bytes": [72]}]},
        {"token": " x", "logprob": -0.1, "bytes": [32, 120], "top_logprobs": []},
    ]}
    assert chat_logprobs([]).model_dump() == {"content": []}


def test_completion_logprobs():
    out = completion_logprobs([entry("ab", 1, -0.5, [("ab", -0.5, 1), ("a", -2.0, 2)]),
                               entry("c", 3, -0.25, [("c", -0.25, 3)])], text_offset_start=3).model_dump()
    assert out == {"tokens": ["ab", "c"], "token_logprobs": [-0.5, -0.25],
                   "top_logprobs": [{"ab": -0.5, "a": -2.0}, {"c": -0.25}], "text_offset": [3, 5]}


def test_completion_top_logprobs_hold_the_token_and_every_alternative():
    """vLLM: the sampled token is among top_logprobs (N + 1 keys when it is not in the top N; logprobs=0
    gives just it); two ids that decode to one text both stay, the second keyed by its id."""
    [sampled_outside, alone, same_text] = completion_logprobs([
        entry("z", 5, -3.0, [("a", -0.5, 1), ("b", -1.0, 2)]),
        entry("z", 5, -3.0, []),
        entry("a", 1, -0.5, [("a", -0.5, 1), ("\ufffd", -1.0, 8), ("\ufffd", -1.5, 9)]),
    ]).top_logprobs
    assert sampled_outside == {"z": -3.0, "a": -0.5, "b": -1.0}
    assert alone == {"z": -3.0}
    assert same_text == {"a": -0.5, "\ufffd": -1.0, "token_id:9": -1.5}


def test_logprobs_stay_json_encodable():
    out = chat_logprobs([entry("a", 1, -0.5, [("b", float("-inf"), 2)])])
    json.loads(out.model_dump_json())
    assert out.content[0].top_logprobs[0].logprob == -9999.0
    json.dumps(completion_logprobs([entry("a", 1, float("-inf"), [])]).model_dump(), allow_nan=False)
