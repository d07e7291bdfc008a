"""POST /generate, SGLang's native API: what `sglang.bench_serving --backend sglang`, SGLang's router and
SGLang's suites (test_matched_stop's meta_info, test_usage_tokens' /generate calls) rely on."""

from __future__ import annotations

import json
import re

import httpx
import pytest

GREEDY = {"temperature": 0, "ignore_eos": True}


def generate(http, **body) -> dict | list:
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def events(http, **body) -> list[dict]:
    """The streamed events, parsed as bench_serving parses them: `data: ` lines up to `[DONE]`."""
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_text_prompt_matches_completions(http, tokenizer):
    """A text prompt is generated exactly as /v1/completions generates it; meta_info counts the tokens
    and says why it ended (SGLang: finish_reason {"type": "length", "length": N})."""
    out = generate(http, text="Once upon a time", sampling_params={"max_new_tokens": 12, **GREEDY})
    completion = http.post("/v1/completions", json={"model": "demo", "prompt": "Once upon a time", "max_tokens": 12,
                                                    **GREEDY}).json()["choices"][0]
    assert out["text"] == completion["text"] and len(out["output_ids"]) == 12
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(tokenizer("Once upon a time", add_special_tokens=False)["input_ids"])
    assert meta["completion_tokens"] == 12 and meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["e2e_latency"] > 0 and meta["id"]


def test_input_ids_prompt_equals_text_prompt(http, tokenizer):
    """`input_ids` is the same prompt as its text."""
    ids = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    params = {"max_new_tokens": 8, **GREEDY}
    by_ids = generate(http, input_ids=ids, sampling_params=params)
    by_text = generate(http, text="Hello world", sampling_params=params)
    assert by_ids["output_ids"] == by_text["output_ids"] and by_ids["meta_info"]["prompt_tokens"] == len(ids)


def test_batch_and_n_answer_a_list_prompt_major(http):
    """A batch of prompts, each sampled n times, is answered with one list: prompt-major, then sample."""
    params = {"max_new_tokens": 6, "n": 2, **GREEDY}
    outs = generate(http, text=["Hello", "The sky is"], sampling_params=params)
    alone = [generate(http, text=t, sampling_params={**params, "n": 1}) for t in ("Hello", "The sky is")]
    assert [o["index"] for o in outs] == [0, 1, 2, 3]
    assert [o["text"] for o in outs] == [alone[0]["text"]] * 2 + [alone[1]["text"]] * 2
    assert isinstance(generate(http, text="Hello", sampling_params={**params, "n": 1}), dict)


def test_stream_carries_the_text_so_far(http):
    """Streamed events carry the whole text and ids so far (bench_serving keeps the last text and counts
    tokens by meta_info.completion_tokens); finish_reason is null until the last event."""
    params = {"max_new_tokens": 10, **GREEDY}
    streamed = events(http, text="Once upon a time", sampling_params=params)
    whole = generate(http, text="Once upon a time", sampling_params=params)
    counts = [e["meta_info"]["completion_tokens"] for e in streamed]
    assert counts == sorted(counts) and counts[-1] == 10
    assert all(e["output_ids"] == whole["output_ids"][:n] for e, n in zip(streamed, counts))
    assert all(later["text"].startswith(earlier["text"]) for earlier, later in zip(streamed, streamed[1:]))
    assert streamed[-1]["text"] == whole["text"]
    assert [e["meta_info"]["finish_reason"] for e in streamed[:-1]] == [None] * (len(streamed) - 1)
    assert streamed[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


def test_stream_of_a_batch_tells_each_event_its_index(http):
    seen = {e["index"] for e in events(http, text=["Hi", "Yo"], sampling_params={"max_new_tokens": 3, **GREEDY})}
    assert seen == {0, 1}


def test_regex_constrains_the_output(http):
    """SGLang's sampling_params.regex: the generated text matches the pattern whole."""
    out = generate(http, text="Once upon a time", sampling_params={"max_new_tokens": 20, "regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop"


def test_json_schema_constrains_the_output(http):
    """SGLang's sampling_params.json_schema (a schema as text): the output parses and follows the schema."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
              "additionalProperties": False}
    out = generate(http, text="Once upon a time", sampling_params={"max_new_tokens": 60, "json_schema": json.dumps(
        schema), "temperature": 1.0, "sampling_seed": 3})
    assert set(json.loads(out["text"])) == {"name"} and out["meta_info"]["finish_reason"]["type"] == "stop"


def test_matched_stop_string(http):
    """SGLang test_finish_stop_str: a stop string ends the text before it; finish_reason is
    {"type": "stop", "matched": <that string>}."""
    free = generate(http, text="Once upon a time", sampling_params={"max_new_tokens": 24, **GREEDY})["text"]
    stop = free[6:9]
    out = generate(http, text="Once upon a time", sampling_params={"max_new_tokens": 24, "stop": ["@@@", stop],
                                                                   **GREEDY})
    assert out["text"] == free[:free.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_matched_stop_token(http):
    """SGLang test_finish_stop_eos: a stop token ends the output with it; `matched` is its id."""
    free = generate(http, text="Once upon a time", sampling_params={"max_new_tokens": 12, **GREEDY})["output_ids"]
    token = free[4]
    out = generate(http, text="Once upon a time", sampling_params={"max_new_tokens": 12, "stop_token_ids": [token],
                                                                   **GREEDY})
    assert out["output_ids"] == free[:free.index(token) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}


@pytest.mark.parametrize("body, status, says", [
    ({"text": "a", "input_ids": [1]}, 400, "exactly one of text or input_ids"),
    ({"sampling_params": {"max_new_tokens": 2}}, 400, "exactly one of text or input_ids"),
    ({"text": "a", "sampling_params": {"no_stop_trim": True}}, 400, "sampling_params.no_stop_trim"),
    ({"text": "a", "sampling_params": {"json_schema": "{\"type\": 7}"}}, 400, "sampling_params.json_schema"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 10 ** 6}}, 400, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}}, 400,
     "sampling_params.min_new_tokens"),
    ({"text": "a", "sampling_params": {"stream": True}}, 400, "give it at the request's top level"),
    ({"text": "a", "return_logprob": True}, 400, "return_logprob is not supported"),
    ({"text": "a", "top_logprobs_num": 2}, 400, "top_logprobs_num is not supported"),
    ({"input_ids": [10 ** 9]}, 400, "token ids"),
    ({"text": "a", "model": "other"}, 404, "does not exist"),
])
def test_bad_requests_get_clear_errors(http, body, status, says):
    """Refused with an OpenAI-style error naming the field as the client spelled it (SGLang's names)."""
    response = http.post("/generate", json=body)
    assert response.status_code == status and says in response.json()["error"]["message"], response.text


def test_text_is_encoded_with_the_bos_ids_as_they_are(bos_server, bos_tokenizer):
    """SGLang encodes /generate's text with the tokenizer's special tokens (a BOS); input_ids are taken as
    sent."""
    with httpx.Client(base_url=bos_server.url, timeout=60) as http:
        text = generate(http, text="Hello there", sampling_params={"max_new_tokens": 1})
        ids = generate(http, input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1})
    assert text["meta_info"]["prompt_tokens"] == len(bos_tokenizer("Hello there").input_ids)
    assert bos_tokenizer("Hello there").input_ids[0] == bos_tokenizer.bos_token_id
    assert ids["meta_info"]["prompt_tokens"] == 3


def test_sglangs_no_op_logprob_fields_are_taken(http):
    """SGLang's test_cache_report.py::test_generate and test_json_constrained.py send return_logprob false,
    top_logprobs_num 0 and logprob_start_len 0 (SGLang's no-ops): answered as without them."""
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4, **GREEDY}}
    plain = generate(http, **body)
    told = generate(http, **body, return_logprob=False, top_logprobs_num=0, logprob_start_len=0)
    assert told["output_ids"] == plain["output_ids"] and told["text"] == plain["text"]
