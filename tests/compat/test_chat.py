"""POST /v1/chat/completions: the generic behaviour of SGLang's run_chat_completion(_stream) and vLLM's
chat tests, with the real `openai` client."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_fixtures import Server

MESSAGES = [{"role": "system", "content": "You are a helpful AI assistant"},
            {"role": "user", "content": "What is the capital of France?"}]


def test_n_with_top_logprobs_and_max_completion_tokens(client):
    """SGLang run_chat_completion: n choices, each an assistant message, each content token with exactly
    top_logprobs alternatives, best first (greedy: the token is the best), the tokens spelling the content;
    max_completion_tokens wins over max_tokens."""
    done = client.chat.completions.create(model="demo", messages=MESSAGES, n=2, max_completion_tokens=6,
                                          max_tokens=50, temperature=0, logprobs=True, top_logprobs=5,
                                          extra_body={"ignore_eos": True})
    assert len(done.choices) == 2
    for choice in done.choices:
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert len(choice.logprobs.content) == 6
        assert all(len(token.top_logprobs) == 5 for token in choice.logprobs.content)
        assert all(isinstance(alt.token, str) for token in choice.logprobs.content for alt in token.top_logprobs)
        for token in choice.logprobs.content:
            best = [alt.logprob for alt in token.top_logprobs]
            assert token.logprob == pytest.approx(best[0]) and best == sorted(best, reverse=True)
        assert "".join(token.token for token in choice.logprobs.content) == choice.message.content
    assert done.usage.prompt_tokens > 0 and done.usage.completion_tokens == 12


def test_stream_roles_one_finish_per_choice_and_usage(client, tokenizer):
    """SGLang run_chat_completion_stream: each choice's first delta has role "assistant", each choice gets
    exactly one finish_reason, and include_usage adds a last chunk with the usage and no choices. The stream
    tells what the whole answer does, and the usage counts the prompt as the chat template writes it."""
    args = dict(model="demo", messages=MESSAGES, n=2, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    first: dict[int, object] = {}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        choice = chunk.choices[0]
        first.setdefault(choice.index, choice.delta)
        finishes[choice.index] += [choice.finish_reason] if choice.finish_reason is not None else []
        texts[choice.index] += choice.delta.content or ""
        if choice.delta.content:
            assert len(choice.logprobs.content[0].top_logprobs) == 3
    assert {i: d.role for i, d in first.items()} == {0: "assistant", 1: "assistant"}
    assert finishes == {0: ["length"], 1: ["length"]}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    whole = client.chat.completions.create(**args)
    assert texts == {c.index: c.message.content for c in whole.choices} and all(texts.values())
    assert [c.finish_reason for c in whole.choices] == ["length", "length"]
    templated = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_tokens = len(tokenizer(templated, add_special_tokens=False)["input_ids"])
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 10


def test_stream_options_without_stream_is_refused(client):
    """vLLM: stream_options without stream: true is a 400."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4,
                                       stream_options={"include_usage": True})
    assert caught.value.body["param"] == "stream_options"


def test_top_logprobs_need_logprobs(client):
    """vLLM test_chat: top_logprobs without logprobs: true is a 400."""
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4, top_logprobs=2)


def test_ignore_eos_runs_to_max_tokens(client):
    """SGLang test_ignore_eos: finish_reason "length" with exactly max_tokens."""
    done = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=30, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 30


def test_frequency_penalty_is_served(client):
    """SGLang test_penalty: frequency_penalty changes nothing about the shape of the answer."""
    done = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8, temperature=0,
                                          frequency_penalty=1.0)
    assert isinstance(done.choices[0].message.content, str)


def test_form_encoded_body_is_refused(demo):
    """vLLM test_request_wrong_content_type: a body that is not JSON gets an error status, not a 200."""
    response = httpx.post(f"{demo.url}/v1/chat/completions", content="messages=hi",
                          headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_stop_token_ids_checked_against_the_vocabulary(client, http):
    """vLLM test_chat_stop_token_ids_*: the last id of the model's vocabulary is a valid stop token; one past
    it is a 400 naming the id and the vocabulary size; a negative id is a 400."""
    vocab = http.get("/get_server_info").json()["vocab_size"]
    done = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5,
                                          extra_body={"stop_token_ids": [vocab - 1]})
    assert done.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5,
                                       extra_body={"stop_token_ids": [vocab + 1]})
    assert str(vocab + 1) in caught.value.message and str(vocab) in caught.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5,
                                       extra_body={"stop_token_ids": [-1]})


def test_max_tokens_beyond_the_context_is_400(client, http):
    """vLLM and SGLang (test_max_tokens_validation): prompt + max_tokens over the context is a 400 in both
    peers' words, never a silently shorter answer; exactly what the context leaves is served, and a request
    without max_tokens gets that room."""
    context = http.get("/get_server_info").json()["max_seq_len"]
    prompt = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=context - prompt + 1)
    body = caught.value.body
    assert (body["param"], body["code"]) == ("max_tokens", "context_length_exceeded")
    assert "Requested token count exceeds the model's maximum context" in body["message"]  # SGLang's words
    assert body["message"].startswith("max_completion_tokens is too large: ")  # SGLang's newer words
    assert f"This model's maximum context length is {context} tokens" in body["message"]  # vLLM's
    assert f"{context - prompt + 1} > {context} - {prompt}" in body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_completion_tokens=context)
    assert caught.value.body["param"] == "max_completion_tokens"
    # Left out, max_tokens is the room left: the request is served (it ends at once on a forced stop token).
    forced = {"logit_bias": {"42": 100}, "stop_token_ids": [42]}
    done = client.chat.completions.create(model="demo", messages=MESSAGES, extra_body=forced)
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens == 1


def test_continuous_usage_stats(client):
    """vLLM and SGLang continuous_usage_stats on chat: every chunk carries the usage so far (the role chunk
    counts no completion tokens yet), counting up to the last chunk's total."""
    chunks = list(client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-2:] == [4, 4]
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


PREFILL = MESSAGES + [{"role": "assistant", "content": "The capital of France is"}]


def test_continue_final_message_prefills_the_answer(client, http, tokenizer):
    """vLLM and SGLang (test_response_prefill) continue_final_message: the trailing assistant message is left
    open, without the end-of-turn token nor a new assistant header, and the model goes on from its last
    word; /tokenize gives the very prompt the chat route runs."""
    opened = http.post("/tokenize", json={"messages": PREFILL, "continue_final_message": True,
                                          "add_generation_prompt": False}).json()["tokens"]
    answer = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    assert opened[-len(answer):] == answer
    closed = http.post("/tokenize", json={"messages": PREFILL}).json()["tokens"]
    assert closed[:len(opened)] == opened and len(closed) > len(opened)  # end of turn, a new turn opened
    done = client.chat.completions.create(model="demo", messages=PREFILL, max_tokens=2,
                                          extra_body={"continue_final_message": True})  # add_generation_prompt: off
    assert done.usage.prompt_tokens == len(opened)


def test_add_generation_prompt(http):
    """vLLM add_generation_prompt (chat and /tokenize): false leaves out the assistant header that true (the
    default) puts after the messages."""
    with_header = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    without = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert with_header[:len(without)] == without and len(with_header) > len(without)
    usage = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1,
                                                    "add_generation_prompt": False}).json()["usage"]
    assert usage["prompt_tokens"] == len(without)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_continue_and_add_generation_prompt_together_is_400(http, path):
    """vLLM: continue_final_message and add_generation_prompt both true contradict each other: a 400."""
    response = http.post(path, json={"messages": PREFILL, "continue_final_message": True,
                                     "add_generation_prompt": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_and_token_ids(client, http, tokenizer, stream):
    """vLLM chat prompt_logprobs and return_token_ids: the response has the prompt's ids (those /tokenize
    gives) and its logprobs (null first, then each token's entry keyed by its id); each choice the output's
    ids, decoding to its text."""
    prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    args = dict(model="demo", messages=MESSAGES, max_tokens=4, temperature=0,
                extra_body={"prompt_logprobs": 1, "return_token_ids": True, "ignore_eos": True})
    if stream:
        chunks = [c.model_dump() for c in client.chat.completions.create(stream=True, **args)]
        prompt_ids = [c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")]
        scored = [c["prompt_logprobs"] for c in chunks if c.get("prompt_logprobs")]
        assert prompt_ids == [prompt] and len(scored) == 1
        positions = scored[0]
        output = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
        text = "".join(choice["delta"].get("content") or "" for c in chunks for choice in c["choices"])
    else:
        done = client.chat.completions.create(**args).model_dump()
        assert done["prompt_token_ids"] == prompt
        positions, output = done["prompt_logprobs"], done["choices"][0]["token_ids"]
        text = done["choices"][0]["message"]["content"]
    assert len(positions) == len(prompt) and positions[0] is None
    assert all(str(t) in position for t, position in zip(prompt[1:], positions[1:], strict=True))
    assert len(output) == 4 and tokenizer.decode(output) == text


def test_cache_salt_keeps_tenants_apart(client):
    """vLLM cache_salt, SGLang test_cache_salt_effectiveness: a request hits the prefix cache of its own salt
    (all but the last prompt token, up to a page) and never another salt's, nor the unsalted cache."""
    messages = [{"role": "user", "content": "What is the capital of Japan? " * 8}]

    def cached(salt: str | None) -> tuple[int, int]:
        usage = client.chat.completions.create(model="demo", messages=messages, max_tokens=2, temperature=0,
                                               extra_body={"cache_salt": salt} if salt else {}).usage
        return usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens

    first, prompt = cached("tenant-a")
    assert first == 0
    again, _ = cached("tenant-a")
    page = prompt - again
    assert 1 <= page <= 64  # every whole page of the prompt but its last token
    assert cached("tenant-b")[0] == 0
    assert cached(None)[0] < again  # at most the chat template's head, which other unsalted requests share
    assert cached("tenant-b")[0] == again and cached(None)[0] == again


def test_every_streamed_delta_after_the_first_has_text(client):
    """SGLang run_chat_completion_stream: after the role chunk every delta's content is a string (possibly
    empty, on a chunk that carries only logprobs or the finish reason), never left out."""
    chunks = list(client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, logprobs=True, top_logprobs=2))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(isinstance(c.choices[0].delta.content, str) for c in chunks[1:])
    assert chunks[-1].choices[0].finish_reason is not None


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63])
def test_seed_outside_64_bits_is_400_naming_the_bound(client, seed):
    """vLLM test_long_seed: a seed outside a signed 64-bit integer is a 400 whose message carries pydantic's
    error type (greater_than_equal / less_than_equal), not a request that runs."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2, seed=seed)
    kind = "greater_than_equal" if seed < 0 else "less_than_equal"
    assert kind in caught.value.message and caught.value.body["param"] == "seed"
    assert caught.value.body["code"] == kind


ECHO_PREFILL = [{"role": "user", "content": "tell me a common saying"},
                {"role": "assistant", "content": "An apple a day, keeps"}]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prefill_before_the_answer(client, stream):
    """vLLM test_chat_echo: with echo, the trailing assistant message being continued comes first in the
    content (streamed: in the first delta); without it, only the continuation."""
    extra = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}

    def content(echo: bool) -> str:
        args = dict(model="demo", messages=ECHO_PREFILL, max_tokens=5, temperature=0,
                    extra_body=extra | {"echo": echo})
        if not stream:
            return client.chat.completions.create(**args).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True))

    plain, echoed = content(False), content(True)
    assert echoed == "An apple a day, keeps" + plain and "An apple a day" not in plain


def test_echo_without_a_trailing_assistant_message_adds_nothing(client):
    """vLLM: echo repeats only an assistant message the answer continues; after a user turn it adds nothing."""
    args = dict(model="demo", messages=MESSAGES, max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**args).choices[0].message.content
    assert client.chat.completions.create(**args, extra_body={"echo": True}).choices[0].message.content == plain


def test_return_tokens_as_token_ids(client):
    """vLLM return_tokens_as_token_ids: each logprobs token (and alternative) is spelled `token_id:N`, N the
    id in token_ids (bytes those of the spelling)."""
    done = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    content = done.choices[0].logprobs.content
    assert [t.token for t in content] == [f"token_id:{i}" for i in done.choices[0].token_ids]
    assert all(bytes(t.bytes).decode() == t.token for t in content)
    assert all(alt.token.startswith("token_id:") for t in content for alt in t.top_logprobs)


TOOL_WITH_DEFS = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "options": {"$ref": "#/$defs/Options"}},
    "required": ["city", "options"],
    "$defs": {"Options": {"type": "object", "additionalProperties": False, "required": ["unit"],
                          "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}}}}


def test_required_tool_choice_with_schema_defs(client):
    """vLLM test_function_tool_use (tool_choice required): parameters that reference their own `$defs` are
    followed (the forced grammar keeps the references working) and come back as a parsed call."""
    done = client.chat.completions.create(model="demo", messages=MESSAGES, tools=[TOOL_WITH_DEFS],
                                          tool_choice="required", parallel_tool_calls=False, max_tokens=300,
                                          temperature=0)
    assert done.choices[0].finish_reason == "tool_calls", done.choices[0]
    [call] = done.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["options"]["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("tools, tool_choice, words", [
    ([TOOL_WITH_DEFS], {"type": "function", "function": {"name": "nonexistent_function"}},
     "Tool 'nonexistent_function' not found in tools list"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "unknown_type"}}}}}], "required", "invalid 'parameters' schema"),
])
def test_tool_errors_in_sglangs_words(client, tools, tool_choice, words):
    """SGLang test_tool_choice: an unknown named function and a forced choice over a parameters schema that
    cannot be followed are 400s whose messages hold SGLang's words."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=MESSAGES, tools=tools, tool_choice=tool_choice,
                                       max_tokens=4)
    assert words in caught.value.message and caught.value.body["param"] == "tool_choice"


def test_token_id_fields_are_null_unless_asked(client):
    """vLLM test_chat_completion_with_tool_use: a chat answer always has `prompt_token_ids` and each choice
    `token_ids` (null without return_token_ids), so clients read them as attributes."""
    plain = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2)
    assert plain.prompt_token_ids is None and plain.choices[0].token_ids is None
    asked = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2,
                                           extra_body={"return_token_ids": True})
    assert asked.prompt_token_ids and len(asked.choices[0].token_ids) == asked.usage.completion_tokens


def test_a_role_the_template_knows_is_passed_to_it(client, http):
    """vLLM test_custom_role: a role outside OpenAI's goes to the chat template as it is (text and text parts
    alike); a template that renders it answers, the demo's Qwen3-like one shows it as a turn of that role."""
    args = dict(model="demo", max_tokens=4, temperature=0)
    as_text = client.chat.completions.create(messages=[{"role": "my-custom-role", "content": "what is 1+1?"}], **args)
    as_parts = client.chat.completions.create(messages=[{"role": "my-custom-role", "content": [
        {"type": "text", "text": "what is 1+1?"}]}], **args)
    assert as_text.choices[0].message.content == as_parts.choices[0].message.content
    tokens = http.post("/tokenize", json={"messages": [{"role": "my-custom-role", "content": "hi"}]}).json()["tokens"]
    assert "my-custom-role" in http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_answer_has_every_field_the_client_declares(client, http):
    """vLLM test_invocations: the keys of the client's `model_dump()` (every field it declares, null when
    empty) are the raw answer's keys, message and choice alike, so the two compare equal."""
    args = dict(model="demo", messages=MESSAGES, max_completion_tokens=3, temperature=0.0)
    dumped = client.chat.completions.create(**args).model_dump()
    raw = http.post("/v1/chat/completions", json=args).json()
    assert dumped.keys() == raw.keys()
    assert dumped["choices"][0].keys() == raw["choices"][0].keys()
    assert dumped["choices"][0]["message"] == raw["choices"][0]["message"]
    assert raw["choices"][0]["message"]["refusal"] is None and raw["system_fingerprint"] is None


def test_an_answer_sent_back_as_it_came_continues_the_conversation(client):
    """OpenAI's client sends an answer's message back with every field it had (`refusal`, `annotations`...
    as null): the next turn is served. vLLM's `reasoning` / `reasoning_content` of an earlier turn goes to
    the template; a non-null output-only field such as `refusal` is refused, naming `messages`."""
    first = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3)
    follow_up = [*MESSAGES, first.choices[0].message, {"role": "user", "content": "And of Germany?"}]
    assert client.chat.completions.create(model="demo", messages=follow_up, max_tokens=3).choices[0].message.content
    thought = {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital"}
    assert client.chat.completions.create(model="demo", messages=[*MESSAGES, thought], max_tokens=2).choices
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", max_tokens=2, messages=[
            *MESSAGES, {"role": "assistant", "content": "no", "refusal": "I won't"}])
    assert caught.value.body["param"] == "messages"


@pytest.fixture(scope="module")
def thinking_server():
    """--demo with Qwen3's reasoning parser; outputs scripted by a regex (the random model never thinks)."""
    srv = Server("--demo", "--reasoning-parser", "qwen3")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def thinking_client(thinking_server):
    return thinking_server.openai_client()


THOUGHT = {"regex": "<think>\nTwo and two[.]\n</think>\n\nIt is 4[.]"}


def reasoning_deltas(client, **extra) -> tuple[list[str], str]:
    """(each non-empty reasoning delta, the whole content) of a streamed scripted answer."""
    pieces, content = [], ""
    for chunk in client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=40, stream=True,
                                                extra_body=THOUGHT | extra):
        for c in chunk.choices:
            pieces += [c.delta.reasoning_content] if getattr(c.delta, "reasoning_content", None) else []
            content += c.delta.content or ""
    return pieces, content


def test_reasoning_has_vllms_name_too(thinking_client):
    """vLLM's test_include_reasoning reads `reasoning` (its name now) or `reasoning_content` (SGLang's)."""
    message = thinking_client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=40,
                                                      extra_body=THOUGHT).choices[0].message
    assert message.reasoning == message.reasoning_content == "\nTwo and two.\n" and message.content == "It is 4."


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_drops_the_thinking(thinking_client, stream):
    """vLLM test_include_reasoning_false_(non_)streaming: no reasoning under either name, the answer kept."""
    if stream:
        assert reasoning_deltas(thinking_client, include_reasoning=False) == ([], "It is 4.")
        return
    message = thinking_client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=40,
                                                      extra_body=THOUGHT | {"include_reasoning": False}).choices[0]
    assert message.message.content == "It is 4." and getattr(message.message, "reasoning_content", None) is None


def test_separate_reasoning_false_leaves_the_thinking_in_the_content(thinking_client):
    """SGLang test_nonstreaming_separate_reasoning_false: the parser is not run, the text is as written."""
    message = thinking_client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=40, extra_body=THOUGHT | {"separate_reasoning": False}
    ).choices[0].message
    assert message.content == "<think>\nTwo and two.\n</think>\n\nIt is 4."
    assert getattr(message, "reasoning_content", None) is None


def test_stream_reasoning_false_sends_the_thinking_whole(thinking_client):
    """SGLang test_streaming_separate_reasoning_true_stream_reasoning_false: one reasoning delta, holding all
    of it, and the same answer as when the thinking streams piece by piece."""
    streamed, content = reasoning_deltas(thinking_client)
    whole, same_content = reasoning_deltas(thinking_client, stream_reasoning=False)
    assert len(streamed) > 1 and whole == ["".join(streamed)] and content == same_content == "It is 4."


def test_reasoning_content_is_null_when_there_is_none(client):
    """SGLang test_reasoning_content (its WithoutParser class) reads `message.reasoning_content` and each
    `delta.reasoning_content` as attributes: present, null, without a reasoning parser."""
    message = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3).choices[0].message
    assert message.reasoning_content is None and message.content
    chunks = list(client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3, stream=True))
    assert all(c.delta.reasoning_content is None for chunk in chunks for c in chunk.choices)


def test_structural_tag_response_format(client):
    """SGLang test_stag_constant_str_openai: a structural tag (xgrammar's `format` objects) is followed exactly,
    even when the answer is absurd; a tag xgrammar does not know is a 400 naming response_format."""
    answer = "The capital of France is Berlin."
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": answer}}
    choice = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=64, temperature=0,
                                            response_format=tag).choices[0]
    assert choice.message.content == answer and choice.finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4, response_format={
            "type": "structural_tag", "format": {"type": "bogus"}})
    assert caught.value.body["param"] == "response_format" and "bogus" in caught.value.message


def test_truncate_prompt_tokens_keeps_the_side_asked(client):
    """vLLM test_chat_completion_truncation_side_controls_prompt_truncation: with truncate_prompt_tokens 4 the
    prompt is its first 4 tokens (truncation_side right) or its last 4 (left)."""
    args = dict(model="demo", messages=MESSAGES, max_tokens=1, temperature=0)
    full = client.chat.completions.create(**args, extra_body={"return_token_ids": True}).prompt_token_ids
    cut = {side: client.chat.completions.create(**args, extra_body={
        "return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": side}).prompt_token_ids
        for side in ("right", "left")}
    assert len(full) > 4 and cut == {"right": full[:4], "left": full[-4:]}


def test_cache_read_input_tokens(client):
    """vLLM test_cache_accounting: usage.cache_read_input_tokens (its name for the prefix-cache hits) is 0 for
    a prompt never seen (a salt of its own: no earlier request shares its cache) and positive when the same
    prompt comes again, whole or streamed."""
    args = dict(model="demo", messages=MESSAGES, max_completion_tokens=2, temperature=0,
                extra_body={"cache_salt": uuid.uuid4().hex})
    first = client.chat.completions.create(**args).usage
    assert first.cache_read_input_tokens == 0 == first.prompt_tokens_details.cached_tokens
    second = client.chat.completions.create(**args).usage
    assert second.cache_read_input_tokens == second.prompt_tokens_details.cached_tokens > 0
    *_, last = client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    assert last.usage.cache_read_input_tokens > 0


def test_prompt_token_ids_stand_for_the_templated_messages(client, http):
    """vLLM test_chat_token_in_matches_messages and _rejects_template_option: the ids /tokenize gives for the
    messages, sent as prompt_token_ids with no messages, answer exactly as the messages do (greedy); the
    template's options with them are a 400, and so is a request with neither."""
    ids = http.post("/tokenize", json={"model": "demo", "messages": MESSAGES}).json()["tokens"]
    args = dict(model="demo", max_completion_tokens=8, temperature=0)
    baseline = client.chat.completions.create(messages=MESSAGES, **args)
    token_in = client.chat.completions.create(messages=[], **args, extra_body={"prompt_token_ids": ids,
                                                                              "return_token_ids": True})
    assert token_in.prompt_token_ids == ids
    assert token_in.choices[0].message.content == baseline.choices[0].message.content
    for option in ({"add_generation_prompt": True}, {"chat_template_kwargs": {"enable_thinking": False}}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(messages=[], **args, extra_body={"prompt_token_ids": ids} | option)
        assert caught.value.body["param"] == next(iter(option))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(messages=[], **args)
    assert caught.value.body["param"] == "messages"


def thought_length(ids: list[int], start: list[int], end: list[int]) -> int | None:
    """Tokens between the last start marker and the first end marker after it, as vLLM's
    test_thinking_token_budget counts them (None: no start marker; no end: up to the last token)."""
    starts = [i for i in range(len(ids) - len(start) + 1) if ids[i:i + len(start)] == start]
    if not starts:
        return None
    first = starts[-1] + len(start)
    return next((j - first for j in range(first, len(ids) - len(end) + 1) if ids[j:j + len(end)] == end),
                len(ids) - first)


THINK = {"chat_template_kwargs": {"force_thinking": True}}  # the demo's template then opens the block: "<think>\n"


def budgeted_ids(client, budget: int | None, stream: bool = False, messages: list[dict] = MESSAGES,
                 **extra) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids) of a greedy answer that thinks from its prompt on, with a thinking budget."""
    body = THINK | {"return_token_ids": True, "ignore_eos": True} | extra
    if budget is not None:
        body["thinking_token_budget"] = budget
    args = dict(model="demo", messages=messages, max_tokens=24, temperature=0, extra_body=body)
    if not stream:
        done = client.chat.completions.create(**args)
        return done.prompt_token_ids, done.choices[0].token_ids
    prompt, output = [], []
    for chunk in client.chat.completions.create(**args, stream=True):
        prompt = getattr(chunk, "prompt_token_ids", None) or prompt
        output += [i for c in chunk.choices for i in (getattr(c, "token_ids", None) or [])]
    return prompt, output


def markers(server: Server) -> tuple[list[int], list[int]]:
    return tuple(httpx.post(f"{server.url}/tokenize", json={"prompt": tag, "add_special_tokens": False}).json()[
        "tokens"] for tag in ("<think>", "</think>"))


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_token_budget_ends_the_thinking_after_n_tokens(thinking_server, stream):
    """vLLM test_thinking_token_budget_limits_reasoning: with thinking_token_budget 5 exactly 5 tokens lie
    between the start marker (the prompt's) and the end marker, whole or streamed; the thinking goes to
    reasoning, what follows the end marker to content. Without a budget the random model never ends it."""
    start, end = markers(thinking_server)
    prompt, output = budgeted_ids(thinking_server.openai_client(), 5, stream)
    assert thought_length(prompt + output, start, end) == 5
    message = thinking_server.openai_client().chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=24, temperature=0,
        extra_body=THINK | {"thinking_token_budget": 5, "ignore_eos": True}).choices[0].message
    assert message.reasoning is not None and "</think>" not in message.content
    free_prompt, free = budgeted_ids(thinking_server.openai_client(), None)
    assert thought_length(free_prompt + free, start, end) == 1 + len(free)  # the prompt's newline, then all


def test_thinking_token_budget_leaves_the_rest_of_the_batch_alone(thinking_server):
    """vLLM test_thinking_token_budget_mixed_requests: requests with and without a budget, sent together, are
    each answered as when sent alone."""
    client = thinking_server.openai_client()
    alone = [budgeted_ids(client, budget) for budget in (3, None, 7)]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda budget: budgeted_ids(client, budget), (3, None, 7)))
    assert together == alone
    start, end = markers(thinking_server)
    assert [thought_length(p + o, start, end) for p, o in together] == [3, 1 + len(alone[1][1]), 7]


def test_thinking_token_budget_is_checked(thinking_server, client):
    """vLLM test_thinking_token_budget_validation: an integer >= -1 (-1: no budget); a budget needs the markers of
    a --reasoning-parser and no grammar; a block the template closes (enable_thinking false) is not counted."""
    thinking = thinking_server.openai_client()
    for bad in (-2, 0.6, 10.5):
        with pytest.raises(openai.BadRequestError) as caught:
            budgeted_ids(thinking, bad)
        assert caught.value.body["param"] == "thinking_token_budget"
    assert budgeted_ids(thinking, -1) == budgeted_ids(thinking, None)
    with pytest.raises(openai.BadRequestError) as caught:
        budgeted_ids(client, 3)
    assert caught.value.body["param"] == "thinking_token_budget" and "--reasoning-parser" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        budgeted_ids(thinking, 3, regex="[a-z]+")
    assert caught.value.body["param"] == "thinking_token_budget"
    closed = {"chat_template_kwargs": {"enable_thinking": False}}
    assert budgeted_ids(thinking, 0, **closed) == budgeted_ids(thinking, None, messages=hinted(MESSAGES, 0), **closed)
    # openapi.json says so: a budget is only -1 on a server without a reasoning parser
    budgets = [httpx.get(f"{srv_url}/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"][
        "properties"]["thinking_token_budget"]["anyOf"][0]
        for srv_url in (thinking_server.url, str(client.base_url).removesuffix("/v1/"))]
    assert [budget.get("maximum") for budget in budgets] == [None, -1]


def hinted(messages: list[dict], budget: int) -> list[dict]:
    """vLLM's thinking-budget hint, in its words, at the end of the system message (or one of its own)."""
    hint = f"Think step by step and use fewer than {budget} reasoning tokens before the final answer."
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + hint}, *messages[1:]]
    return [{"role": "system", "content": hint}, *messages]


@pytest.mark.parametrize("messages", [MESSAGES, MESSAGES[1:]])
def test_thinking_token_budget_tells_the_model(thinking_server, messages):
    """vLLM test_thinking_budget_prompt_hint_*: with a budget, the prompt is the conversation whose system
    message ends with vLLM's hint ("use fewer than N reasoning tokens"), or that starts with the hint alone."""
    client = thinking_server.openai_client()
    assert budgeted_ids(client, 9, messages=messages)[0] == budgeted_ids(client, None, messages=hinted(
        messages, 9))[0] != budgeted_ids(client, None, messages=messages)[0]


def test_a_template_that_writes_the_bos_gets_it_once(bos_server, bos_tokenizer):
    """vLLM's chat add_special_tokens (default false): the prompt is the template's text, whose own BOS (Llama
    3's template writes <|begin_of_text|>) comes once; true adds the tokenizer's on top, as vLLM does."""
    client = bos_server.openai_client()
    bos = bos_tokenizer.bos_token_id
    text = bos_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)

    def prompt_ids(**extra) -> list[int]:
        return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, extra_body={
            "return_token_ids": True} | extra).prompt_token_ids

    once = prompt_ids()
    assert once == bos_tokenizer(text, add_special_tokens=False).input_ids and once.count(bos) == 1 == once.index(
        bos) + 1
    assert prompt_ids(add_special_tokens=True) == [bos, *once]


@pytest.mark.parametrize("stream", [False, True])
def test_orca_load_report_in_text(client, stream):
    """vLLM test_chat_completion_with_orca_header: `endpoint-load-metrics-format: TEXT` gets vLLM's native-HTTP
    form, `TEXT named_metrics.<name>=<value>, ...`, on a whole or a streamed answer."""
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=MESSAGES, max_tokens=2, stream=stream,
        extra_headers={"endpoint-load-metrics-format": "TEXT"})
    kind, _, report = raw.headers["endpoint-load-metrics"].partition(" ")
    pairs = dict(pair.split("=") for pair in report.split(", "))
    assert kind == "TEXT" and set(pairs) == {"named_metrics.kv_cache_usage_perc", "named_metrics.num_requests_waiting"}
    assert all(float(value) >= 0 for value in pairs.values())
    if stream:
        list(raw.parse())  # read to the end: the stream is then closed


@pytest.mark.parametrize("stream", [False, True])
def test_return_hidden_states_on_each_choice(bos_server, bos_model, stream):
    """SGLang run_chat_completion(_stream) with return_hidden_states: each of n choices has `hidden_states` (the
    model's hidden size of floats), streamed in one delta of its own per choice, and no other chunk has the key."""
    client = bos_server.openai_client()
    args = dict(model="tiny", messages=MESSAGES, n=2, max_tokens=3, temperature=1.0,
                extra_body={"return_hidden_states": True, "ignore_eos": True})
    size = json.loads((Path(bos_model) / "config.json").read_text())["hidden_size"]
    if stream:
        found = [c.delta.hidden_states for chunk in client.chat.completions.create(**args, stream=True)
                 for c in chunk.choices if hasattr(c.delta, "hidden_states")]
    else:
        found = [c.hidden_states for c in client.chat.completions.create(**args).choices]
    assert len(found) == 2 and all(len(h) == size and all(isinstance(x, float) for x in h) for h in found)
