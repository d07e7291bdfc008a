"""The validation boundary in-process, with the real tokenizer: every request field fuzzed with random JSON
(hypothesis), the conversions to SamplingParams, and the offline LLM API refusing the same requests."""

from __future__ import annotations

import asyncio
import re

import pytest
from helpers import make_llm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from transformers import AutoTokenizer

from minisgl import SamplingParams
from minisgl.core import check_token_ids
from minisgl.server.boundary import CheckedRequest, ModelLimits, prepare
from minisgl.server.errors import ApiError, field_path
from minisgl.server.routes.chat import chat_plan
from minisgl.server.routes.completions import completion_plan
from minisgl.server.schemas.chat import ChatCompletionRequest
from minisgl.server.schemas.completions import CompletionRequest
from minisgl.server.text import Conversation, TextCodec

LIMITS = ModelLimits(vocab_size=512, max_seq_len=64, kv_capacity=4096)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.fixture(scope="module")
def codec(tiny_models) -> TextCodec:
    return TextCodec(AutoTokenizer.from_pretrained(tiny_models["qwen3"]))


def run(codec: TextCodec, body: dict, limits: ModelLimits = LIMITS) -> CheckedRequest:
    """What the server does with a JSON body: parse it with the route's model, then the boundary."""
    if "messages" in body:
        req = ChatCompletionRequest.model_validate(body)
        plan = chat_plan(req, None, Conversation([{"role": m.role, "content": m.text()} for m in req.messages]))
    else:
        plan = completion_plan(CompletionRequest.model_validate(body))
    return asyncio.run(prepare(codec, limits, plan))


def refusal(codec: TextCodec, body: dict, limits: ModelLimits = LIMITS) -> ApiError:
    with pytest.raises(ApiError) as e:
        run(codec, body, limits)
    assert e.value.status == 400
    return e.value


# ---------------------------------------------------------------- conversions


def test_defaults(codec):
    gen = run(codec, CHAT)
    assert gen.params == SamplingParams(max_tokens=LIMITS.max_seq_len - len(gen.prompts[0]))
    assert gen.params.logprobs is None and gen.stop == [] and gen.n == 1 and gen.seed is None
    assert run(codec, COMPLETION).params.max_tokens == 16


def test_fields_pass_through(codec):
    p = run(codec, CHAT | dict(temperature=0, top_p=0.5, top_k=20, min_p=0.1, seed=7, min_tokens=3,
                               stop_token_ids=[5, 6], ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5,
                               repetition_penalty=1.2, max_tokens=30)).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0, 0.5, 20, 0.1, 7)
    assert (p.min_tokens, p.max_tokens, p.stop_token_ids, p.ignore_eos) == (3, 30, [5, 6], True)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert run(codec, CHAT | {"top_k": 0}).params.top_k == -1  # vLLM's "off"


def test_max_tokens_choice_and_room(codec):
    """Left out, max_tokens (and min_tokens with it) is lowered to the room the context leaves; asked for
    beyond that room, it is refused as vLLM and SGLang refuse it."""
    room = LIMITS.max_seq_len - len(run(codec, CHAT).prompts[0])
    assert run(codec, CHAT | {"max_tokens": 10, "max_completion_tokens": 20}).params.max_tokens == 20
    assert run(codec, CHAT | {"max_tokens": 10}).params.max_tokens == 10
    assert run(codec, CHAT | {"max_completion_tokens": room}).params.max_tokens == room
    error = refusal(codec, CHAT | {"max_completion_tokens": room + 1})
    assert (error.param, error.code) == ("max_completion_tokens", "context_length_exceeded")
    p = run(codec, {"model": "m", "prompt": [1] * 60, "min_tokens": 400}).params
    assert (p.max_tokens, p.min_tokens) == (4, 4)


def test_logit_bias_reaches_the_sampler_as_ids(codec):
    assert run(codec, COMPLETION | {"logit_bias": {"5": 1.5, "7": -100}}).params.logit_bias == {5: 1.5, 7: -100}


def test_logprobs(codec):
    assert run(codec, CHAT | {"logprobs": True}).params.logprobs == 0
    assert run(codec, CHAT | {"logprobs": True, "top_logprobs": 5}).params.logprobs == 5
    assert run(codec, COMPLETION | {"logprobs": 20}).params.logprobs == 20


def test_batches_and_stop_strings(codec):
    gen = run(codec, {"model": "m", "prompt": ["hi", "hello there"], "n": 3, "seed": 2**63 - 1, "stop": "\n"})
    assert len(gen.prompts) == 2 and gen.n == 3 and gen.seed == 2**63 - 1 and gen.stop == ["\n"]
    assert gen.prompts[1] == codec.tokenizer("hello there", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("body, param, code", [
    (COMPLETION | {"stop_token_ids": [512 + 1000], "min_tokens": 2}, "stop_token_ids", None),  # crashed a scheduler
    (CHAT | {"stop_token_ids": [2**70], "min_tokens": 1}, "stop_token_ids", None),  # crashed a scheduler
    ({"model": "m", "prompt": [1, 2, 512]}, "prompt", None),
    ({"model": "m", "prompt": [[1], [2**70]]}, "prompt", None),
    (COMPLETION | {"min_tokens": 20, "max_tokens": 10}, "min_tokens", None),
    (CHAT | {"min_tokens": 20, "max_completion_tokens": 10}, "min_tokens", None),
    (CHAT | {"top_logprobs": 3}, "top_logprobs", None),
    (CHAT | {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less_than_equal"),  # over --max-logprobs
    (COMPLETION | {"logprobs": 21}, "logprobs", "less_than_equal"),
    (COMPLETION | {"prompt_logprobs": 21}, "prompt_logprobs", "less_than_equal"),
    (COMPLETION | {"logit_bias": {"512": 1}}, "logit_bias", None),
    ({"model": "m", "prompt": [1] * 64}, "prompt", "context_length_exceeded"),
    ({"model": "m", "prompt": "word " * 100}, "prompt", "context_length_exceeded"),
    (CHAT | {"messages": [{"role": "user", "content": "word " * 100}]}, "messages", "context_length_exceeded"),
])
def test_refusals_name_the_field(codec, body, param, code):
    error = refusal(codec, body)
    assert (error.param, error.code) == (param, code)
    assert error.message.startswith(param) or code is not None


def test_text_too_long_is_counted_not_materialized(codec):
    text = "word " * 5000
    count, ids = asyncio.run(codec.encode(text, LIMITS.max_seq_len))
    assert ids == [] and count == len(codec.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert f"has {count} tokens" in refusal(codec, {"model": "m", "prompt": text}).message


def test_kv_pool_smaller_than_the_prompt(codec):
    error = refusal(codec, {"model": "m", "prompt": [1] * 40}, ModelLimits(512, 64, kv_capacity=32))
    assert error.code == "context_length_exceeded" and "KV pool" in error.message


def test_without_a_tokenizer_only_token_ids_are_served():
    codec = TextCodec(None)
    assert run(codec, {"model": "m", "prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    for body, param in [(COMPLETION, "prompt"), (CHAT, "messages"), ({"model": "m", "prompt": [1], "stop": "x"},
                                                                     "stop")]:
        error = refusal(codec, body)
        assert error.param == param and "--skip-tokenizer-init" in error.message


# ---------------------------------------------------------------- random JSON for every field

TEXT = st.text(st.characters(exclude_categories=()), max_size=20)  # lone surrogates included
INTS = st.integers() | st.sampled_from([2**70, -2**70, 2**63, 511, 512, -1, 0])
JSON = st.recursive(st.none() | st.booleans() | INTS | st.floats() | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=8)
CHAT_FIELDS = sorted(ChatCompletionRequest.model_fields)
COMPLETION_FIELDS = sorted(CompletionRequest.model_fields)


def accepted_or_refused_naming(codec: TextCodec, body: dict, field: str) -> None:
    try:
        run(codec, body)
    except ValidationError as exc:
        assert field_path(exc.errors()[0]["loc"])[0] == field, exc
    except ApiError as exc:
        assert exc.status == 400 and exc.param == field, exc.body()


@pytest.mark.parametrize("field", CHAT_FIELDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=JSON)
def test_chat_field_with_any_json_is_accepted_or_refused_by_name(codec, field, value):
    accepted_or_refused_naming(codec, CHAT | {field: value}, field)


@pytest.mark.parametrize("field", COMPLETION_FIELDS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=JSON)
def test_completion_field_with_any_json_is_accepted_or_refused_by_name(codec, field, value):
    accepted_or_refused_naming(codec, COMPLETION | {field: value}, field)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(INTS, max_size=6), field=st.sampled_from(["prompt", "stop_token_ids"]))
def test_token_ids_anywhere_are_checked_against_the_vocabulary(codec, ids, field):
    body = {"model": "m", "prompt": [1, 2], field: ids}
    if all(0 <= t < LIMITS.vocab_size for t in ids) and (ids or field == "stop_token_ids"):
        run(codec, body)
    else:
        accepted_or_refused_naming(codec, body, field)
        with pytest.raises((ValidationError, ApiError)):
            run(codec, body)


@pytest.mark.parametrize("bad", [None, True, 2.0, "7", -1, 512])
def test_an_id_list_holding_anything_but_a_vocabulary_id_is_refused_naming_it(bad):
    """The check's fast path (all plain ints in range) must not let anything else through: None included,
    which the one-by-one scan once took for "nothing bad found"."""
    with pytest.raises(ValueError, match=re.escape(f"got {bad!r}: out of vocabulary")):
        check_token_ids([1, bad, 2], 512, "prompt")
    check_token_ids([0, 1, 511], 512, "prompt")


# ---------------------------------------------------------------- the offline API shares the checks


def test_offline_llm_refuses_the_same_requests(tiny_models):
    llm = make_llm(tiny_models["qwen3"], num_pages=256)
    vocab = llm.engine.config.vocab_size
    with pytest.raises(ValueError, match="^stop_token_ids .*got 1180591620717411303424"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[2**70], min_tokens=1))
    with pytest.raises(ValueError, match=f"^stop_token_ids .*got {vocab + 1000}"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[vocab + 1000], min_tokens=2))
    with pytest.raises(ValueError, match="^prompt "):
        llm.generate([[1, vocab]], SamplingParams())
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2, stop_token_ids=[vocab - 1]))[0].finish_reason
