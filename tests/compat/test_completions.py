"""POST /v1/completions: the generic behaviour of SGLang's run_completion(_stream) and vLLM's completion
tests, with the real `openai` client."""

from __future__ import annotations

import json
import math
import re

import httpx
import openai
import pytest
import torch
from helpers import DEVICE, hf_greedy, hf_model

PROMPT = "The capital of France is"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
          "additionalProperties": False}


@pytest.mark.parametrize("token_input", [False, True])
def test_batch_times_n_choices_and_prompt_usage(client, tokenizer, token_input):
    """SGLang run_completion: a list of 2 prompts with n=2 gives 4 choices; prompt_tokens counts both
    prompts; text and token-id prompts are the same prompt."""
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    prompt = ids if token_input else PROMPT
    done = client.completions.create(model="demo", prompt=[prompt, prompt], n=2, max_tokens=8, temperature=0)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert done.usage.prompt_tokens == 2 * len(ids) and done.usage.completion_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert done.id and done.created


def test_logprobs_shape(client):
    """SGLang run_completion with logprobs=5: tokens are strings, each top_logprobs entry a non-empty dict,
    and the first token's logprob is a number."""
    done = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5,
                                     extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert all(isinstance(t, str) for t in lp.tokens) and len(lp.tokens) == 6
    assert all(isinstance(top, dict) and top for top in lp.top_logprobs)
    assert isinstance(lp.token_logprobs[0], float) and lp.token_logprobs[0] <= 0


def test_stream_every_choice_then_usage(client):
    """SGLang run_completion_stream: with a batch and n, every choice index streams, and the last chunk
    carries the usage with no choices (stream_options.include_usage)."""
    chunks = list(client.completions.create(model="demo", prompt=[PROMPT, "Hello"], n=2, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}, temperature=0))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1, 2, 3}
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert {c.id for c in chunks} == {chunks[0].id}


def test_stream_options_without_stream_is_refused(client):
    """vLLM: stream_options on a request that does not stream is a 400, not silently ignored."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, stream_options={"include_usage": True})
    assert caught.value.body["param"] == "stream_options"


def test_ignore_eos_runs_to_max_tokens(client):
    """SGLang test_ignore_eos: with ignore_eos the completion runs to max_tokens, finish_reason "length"."""
    done = client.completions.create(model="demo", prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 40


def test_prompt_longer_than_the_context_is_400(client, http):
    """SGLang test_input_length_longer_than_context_length, vLLM's long-prompt tests: a 400 with OpenAI's
    context_length_exceeded code, never a truncated prompt, in words both peers' clients match."""
    context = http.get("/get_server_info").json()["max_seq_len"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt=[7] * (context + 1), max_tokens=4)
    assert caught.value.body["code"] == "context_length_exceeded"
    message = caught.value.body["message"]
    assert "is longer than the model's context length" in message  # SGLang's words
    assert f"maximum context length is {context} tokens" in message  # vLLM's and OpenAI's


def test_model_may_be_left_out(http):
    """vLLM's and SGLang's requests may leave `model` out (vLLM test_server_load does): the served model
    answers. A null model is still refused."""
    done = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert done.status_code == 200 and done.json()["model"] == "demo"
    refused = http.post("/v1/completions", json={"model": None, "prompt": PROMPT, "max_tokens": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


@pytest.mark.parametrize("include_usage, continuous", [(True, True), (True, False), (False, True), (None, None)])
def test_continuous_usage_stats(client, include_usage, continuous):
    """vLLM test_completion_stream_options, SGLang test_continuous_usage_stats: with include_usage and
    continuous_usage_stats every chunk carries its choice's usage so far (prompt + completion = total),
    then the last chunk the whole; continuous_usage_stats without include_usage adds nothing (vLLM)."""
    options = {"include_usage": include_usage, "continuous_usage_stats": continuous}
    chunks = list(client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                            stream_options=options, extra_body={"ignore_eos": True}))
    texts = [c for c in chunks if c.choices]
    if include_usage and continuous:
        counts = [c.usage.completion_tokens for c in texts]  # a token may wait for the next one's bytes
        assert counts[0] >= 1 and counts == sorted(set(counts)) and counts[-1] == 5
        assert all(c.usage.prompt_tokens > 0 and c.usage.total_tokens == c.usage.prompt_tokens
                   + c.usage.completion_tokens for c in texts)
    else:
        assert all(c.usage is None for c in texts)
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    else:
        assert len(texts) == len(chunks)


@pytest.mark.parametrize("n_logprobs", [0, 1, 5])
def test_logprobs_hold_the_sampled_token(client, n_logprobs):
    """vLLM test_zero_logprobs / test_some_logprobs: each position's top_logprobs holds the sampled token
    (its logprob is token_logprobs') and the N best, so N or N + 1 keys (1 for logprobs=0), never fewer:
    tokens that decode to one text do not overwrite each other."""
    for sampling in ({"temperature": 0}, {"temperature": 2.0, "seed": 5}):
        done = client.completions.create(model="demo", prompt=[0, 0, 0, 0, 0], max_tokens=12, logprobs=n_logprobs,
                                         extra_body={"ignore_eos": True}, **sampling)
        lp = done.choices[0].logprobs
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top[token] == logprob
            assert len(top) in (max(n_logprobs, 1), n_logprobs + 1)
            if sampling["temperature"] == 0:  # the greedy token is the best one
                assert len(top) == max(n_logprobs, 1) and logprob == max(top.values())
        if sampling["temperature"] > 0 and n_logprobs > 0:  # a hot draw from a random model leaves the top N
            assert any(len(top) == n_logprobs + 1 for top in lp.top_logprobs)


@pytest.mark.parametrize("prompt_logprobs", [0, 2, None])
def test_prompt_logprobs(client, tokenizer, prompt_logprobs):
    """vLLM test_prompt_logprobs_completion: each choice carries prompt_logprobs (null when not asked for):
    null for the first prompt token, then the token itself (keyed by id, with its decoded text) and the N
    best; the same numbers echo + logprobs gives."""
    prompts = ["A robot may not injure another robot", "My name is"]
    extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    done = client.completions.create(model="demo", prompt=prompts, max_tokens=2, extra_body=extra)
    if prompt_logprobs is None:
        assert all(c.prompt_logprobs is None for c in done.choices)
        return
    for choice, prompt in zip(done.choices, prompts, strict=True):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        positions = choice.prompt_logprobs
        assert len(positions) == len(ids) and positions[0] is None
        for token_id, position in zip(ids[1:], positions[1:], strict=True):
            assert position[str(token_id)]["decoded_token"] == tokenizer.decode([token_id])
            assert len(position) in (max(prompt_logprobs, 1), prompt_logprobs + 1)
            ranked = sorted((p for p in position.values() if p["rank"] is not None), key=lambda p: p["rank"])
            assert [p["rank"] for p in ranked] == list(range(1, prompt_logprobs + 1))
        echo = client.completions.create(model="demo", prompt=prompt, max_tokens=1, echo=True, logprobs=1)
        assert echo.choices[0].logprobs.token_logprobs[1:len(ids)] == pytest.approx(
            [position[str(t)]["logprob"] for t, position in zip(ids[1:], positions[1:], strict=True)], abs=1e-5)


def test_prompt_logprobs_temperature(client):
    """vLLM test_prompt_logprobs_temperature_increases_argmax_prob: the prompt's logprobs come from logits
    divided by prompt_logprobs_temperature, so the greedy continuation, scored as the prompt's last token, is
    likelier at 0.1 than at 1 than at 5; without prompt_logprobs the setting is a 400 naming it."""
    seed = [5, 5, 5, 5, 5]
    greedy = client.completions.create(model="demo", prompt=seed, max_tokens=1, temperature=0,
                                       extra_body={"return_token_ids": True}).choices[0].token_ids
    def last_prob(temperature: float) -> float:
        done = client.completions.create(model="demo", prompt=seed + greedy, max_tokens=1, temperature=0, extra_body={
            "prompt_logprobs": 0, "prompt_logprobs_temperature": temperature})
        [entry] = done.choices[0].prompt_logprobs[-1].values()
        return math.exp(entry["logprob"])
    assert last_prob(0.1) > last_prob(1.0) > last_prob(5.0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt=seed, max_tokens=1,
                                  extra_body={"prompt_logprobs_temperature": 0.5})
    assert caught.value.body["param"] == "prompt_logprobs_temperature"


def test_prompt_logprobs_below_zero_is_400(client):
    """vLLM: prompt_logprobs -1 (its "the whole vocabulary") is a 400 here, as any count outside 0..20."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": -1})
    assert caught.value.body["param"] == "prompt_logprobs"


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids(client, tokenizer, stream):
    """vLLM return_token_ids (test_prompt_logprobs_temperature_increases_argmax_prob_completion reads them):
    each choice has the prompt's ids and the output's, the latter decoding to the text."""
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    args = dict(model="demo", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"return_token_ids": True,
                                                                                    "ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **args))
        prompt_ids = [c.choices[0].prompt_token_ids for c in chunks if getattr(c.choices[0], "prompt_token_ids", None)]
        assert prompt_ids == [ids]
        output = [t for c in chunks for t in c.choices[0].token_ids]
        text = "".join(c.choices[0].text for c in chunks)
    else:
        choice = client.completions.create(**args).choices[0]
        assert choice.prompt_token_ids == ids
        output, text = choice.token_ids, choice.text
    assert len(output) == 6 and tokenizer.decode(output) == text


def test_logit_bias(client, http):
    """OpenAI logit_bias (vLLM and SGLang serve it): +100 makes one token the only choice, -100 bans the greedy
    one, logprobs stay the model's; an id outside the vocabulary is a 400 naming logit_bias."""
    args = dict(model="demo", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    vocab = http.get("/get_server_info").json()["vocab_size"]
    free = client.completions.create(**args).choices[0]
    forced = client.completions.create(**args, logit_bias={str(vocab - 3): 100}).choices[0]
    assert forced.token_ids == [vocab - 3] * 3
    assert forced.logprobs.token_logprobs[0] < free.logprobs.token_logprobs[0]  # not the biased logits'
    banned = client.completions.create(**args, logit_bias={str(free.token_ids[0]): -100}).choices[0]
    assert banned.token_ids[0] != free.token_ids[0]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**args, logit_bias={str(vocab): 1})
    assert caught.value.body["param"] == "logit_bias" and str(vocab) in caught.value.body["message"]


CITIES = ["Paris", "Lyon", "Saint-Étienne", 'say "hi"']


def one_of_cities(text: str) -> bool:
    return text in CITIES


def code(text: str) -> bool:
    return re.fullmatch("[0-9]{3}-[a-z]{2}", text) is not None


def yes_or_no(text: str) -> bool:
    return text in ("yes", "no")


@pytest.mark.parametrize("extra, matches", [
    ({"structured_outputs": {"choice": CITIES}}, one_of_cities), ({"guided_choice": CITIES}, one_of_cities),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, code), ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, code),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, yes_or_no),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, yes_or_no),
])
def test_vllm_structured_outputs(client, extra, matches):
    """vLLM structured_outputs (choice, regex, grammar) and their older guided_* spellings: every sampled
    output matches."""
    done = client.completions.create(model="demo", prompt=PROMPT, max_tokens=30, n=4, temperature=1.0, seed=1,
                                     extra_body=extra)
    assert all(matches(choice.text) for choice in done.choices)


@pytest.mark.parametrize("extra", [{"structured_outputs": {"json": SCHEMA}}, {"guided_json": SCHEMA},
                                   {"guided_json": json.dumps(SCHEMA)}])
def test_vllm_json_schema(client, extra):
    """vLLM structured_outputs.json / guided_json (an object or its text): the output validates."""
    done = client.completions.create(model="demo", prompt=PROMPT, max_tokens=80, temperature=1.0, seed=2,
                                     extra_body=extra)
    answer = json.loads(done.choices[0].text)
    assert set(answer) == {"city"} and isinstance(answer["city"], str)


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": 12}}}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[.*"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= select_statementinvalidsyntax"}}, "structured_outputs"),
    ({"guided_regex": "[.*"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
])
def test_vllm_invalid_structured_outputs_are_400(client, extra, param):
    """vLLM test_invalid_json_schema / _regex / _grammar: a grammar that cannot be followed, or two at once, is
    a 400 naming the field."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, extra_body=extra)
    assert caught.value.body["param"] == param


def test_matched_stop(http):
    """SGLang test_finish_length / test_finish_stop_str (chat and completions): each choice says what ended it,
    `matched_stop` null on "length", the stop string or the stop token id on "stop"."""
    base = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = http.post("/v1/completions", json=base | {"return_token_ids": True}).json()["choices"][0]
    assert (free["finish_reason"], free["matched_stop"]) == ("length", None)
    stop = free["text"][3:5]
    by_text = http.post("/v1/completions", json=base | {"stop": [stop]}).json()["choices"][0]
    assert (by_text["finish_reason"], by_text["matched_stop"]) == ("stop", stop)
    token = free["token_ids"][2]
    by_token = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                       "max_tokens": 5, "stop_token_ids": [token], "temperature": 0,
                                                       "logit_bias": {str(token): 100}}).json()["choices"][0]
    assert (by_token["finish_reason"], by_token["matched_stop"]) == ("stop", token)


def test_echo_logprobs_and_prompt_logprobs_keep_their_own_counts(client):
    """echo's logprobs=N and prompt_logprobs=M share one computation, yet each lists its own count of the
    best tokens (N and M, plus the token itself when it is not among them)."""
    done = client.completions.create(model="demo", prompt=PROMPT, max_tokens=1, echo=True, logprobs=3,
                                     extra_body={"prompt_logprobs": 1})
    choice = done.choices[0]
    assert all(len(position) <= 2 for position in choice.prompt_logprobs[1:])
    assert all(3 <= len(top) <= 4 for top in choice.logprobs.top_logprobs[1:])


def test_out_of_vocabulary_prompt_is_400_saying_so(client):
    """vLLM test_out_of_vocab_token_ids: a token id past the vocabulary is a 400 that says "out of vocabulary"."""
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model="demo", prompt=[999999], max_tokens=5, temperature=0.0)


def test_return_tokens_as_token_ids_with_echo(client):
    """vLLM test_comparison_with_prompt_logprobs_and_logprobs: with return_tokens_as_token_ids, logprobs
    tokens are `token_id:N`; with echo they are the prompt's ids then the output's (text_offset still counts
    characters of the text)."""
    done = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1,
                                     extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    choice = done.choices[0]
    ids = choice.prompt_token_ids + choice.token_ids
    assert choice.logprobs.tokens == [f"token_id:{i}" for i in ids]
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs[1:] for key in top)
    assert choice.logprobs.text_offset[len(choice.prompt_token_ids)] == len(PROMPT)


def test_truncate_prompt_tokens_serves_a_prompt_longer_than_the_context(client, http, tokenizer):
    """vLLM's truncate_prompt_tokens: a text prompt past the context is served from its last N tokens (echo
    shows those), where without it the prompt is a 400; truncation_side alone is a 400 naming it."""
    context = http.get("/v1/models/demo").json()["max_model_len"]
    prompt = "word " * (context + 10)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt=prompt, max_tokens=1)
    kept = client.completions.create(model="demo", prompt=prompt, max_tokens=1, echo=True,
                                     extra_body={"truncate_prompt_tokens": 10})
    assert kept.usage.prompt_tokens == 10
    assert kept.choices[0].text.startswith(tokenizer.decode(tokenizer.encode(prompt)[-10:]))
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt="hi", max_tokens=1, extra_body={"truncation_side": "left"})
    assert caught.value.body["param"] == "truncation_side"


def test_return_token_ids_with_echo_keeps_the_prompt_apart(client, tokenizer):
    """vLLM test_token_in_token_out_and_logprobs: with echo and return_token_ids a choice's token_ids are the
    output's alone (at most max_tokens) and prompt_token_ids the prompt's, which decode to its text."""
    text = "Hello, world! How are you today?"
    ids = tokenizer.encode(text)
    choice = client.completions.create(model="demo", prompt=ids, max_tokens=5, temperature=0, echo=True,
                                       extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    assert len(choice.token_ids) == 5 and choice.prompt_token_ids == ids
    assert tokenizer.decode(choice.prompt_token_ids) == text and choice.text.startswith(text)


def test_text_prompts_begin_with_the_bos_as_the_peers_encode_them(bos_server, bos_tokenizer, bos_model):
    """vLLM's add_special_tokens (default true) and SGLang's encoding: a text prompt gets the tokenizer's special
    tokens (Llama 3's <|begin_of_text|>), counted in the usage, and the output is what transformers generates
    from those ids; false leaves them out; token ids are taken as they are; echo shows the text as sent and
    scores the BOS first (null)."""
    client = bos_server.openai_client()
    bos = bos_tokenizer.bos_token_id

    def complete(prompt, **extra):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True} | extra)

    for special in (True, False):
        done = complete(PROMPT, **({} if special else {"add_special_tokens": False}))
        ids = bos_tokenizer(PROMPT, add_special_tokens=special).input_ids
        assert (ids[0] == bos) is special and done.choices[0].prompt_token_ids == ids
        assert done.usage.prompt_tokens == len(ids)
        assert done.choices[0].token_ids == hf_greedy(bos_model, [ids], 6)[0]
    plain = bos_tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert complete(plain).choices[0].prompt_token_ids == plain
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, echo=True, logprobs=0)
    logprobs = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith(PROMPT)
    assert logprobs.tokens[0] == bos_tokenizer.bos_token and logprobs.token_logprobs[0] is None
    assert len(logprobs.tokens) == echoed.usage.prompt_tokens + 1


def test_orca_load_report_on_request(client):
    """vLLM test_completion_with_orca_header: `endpoint-load-metrics-format: JSON` is answered with an
    `endpoint-load-metrics` header, vLLM's ORCA report (KV-cache usage, waiting requests); no header asked for,
    or a format vLLM does not know, gets none."""
    def headers(**extra) -> dict:
        return client.completions.with_raw_response.create(model="demo", prompt=PROMPT, max_tokens=2,
                                                           extra_headers=extra).headers

    kind, _, report = headers(**{"endpoint-load-metrics-format": "JSON"})["endpoint-load-metrics"].partition(" ")
    metrics = json.loads(report)["named_metrics"]
    assert kind == "JSON" and set(metrics) == {"kv_cache_usage_perc", "num_requests_waiting"}
    assert 0 <= metrics["kv_cache_usage_perc"] <= 1 and metrics["num_requests_waiting"] >= 0
    assert "endpoint-load-metrics" not in headers()
    assert "endpoint-load-metrics" not in headers(**{"endpoint-load-metrics-format": "XML"})


def test_return_hidden_states_are_the_models(bos_server, bos_model, client):
    """SGLang test_openai_server_hidden_states: with --enable-return-hidden-states, return_hidden_states gives each
    choice `hidden_states`, the final hidden state (after the last norm) its last token was sampled from, as
    transformers computes it; streamed, in one chunk of its own per choice; not asked for, no such key; an answer
    of one token has [] (SGLang's: its token came from the prefill). Without the flag: a 400."""
    http = httpx.Client(base_url=bos_server.url, timeout=60)
    body = {"prompt": [PROMPT, "Hello"], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "return_hidden_states": True}
    whole = http.post("/v1/completions", json=body).json()["choices"]
    for choice in whole:
        ids = choice["prompt_token_ids"] + choice["token_ids"][:-1]
        with torch.no_grad():
            out = hf_model(bos_model)(torch.tensor([ids], device=DEVICE), output_hidden_states=True)
        expected = out.hidden_states[-1][0, -1].float().cpu()
        assert torch.allclose(torch.tensor(choice["hidden_states"]), expected, rtol=1e-3, atol=1e-3)
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as events:
        chunks = [json.loads(line[6:]) for line in events.iter_lines() if line.startswith("data: {")]
    carrying = [c for chunk in chunks for c in chunk["choices"] if "hidden_states" in c]
    assert sorted(c["index"] for c in carrying) == [0, 1]
    streamed = {c["index"]: torch.tensor(c["hidden_states"]) for c in carrying}  # batched apart: float rounding
    assert all(torch.allclose(streamed[c["index"]], torch.tensor(c["hidden_states"]), atol=1e-4) for c in whole)
    assert "hidden_states" not in http.post("/v1/completions", json=body | {"return_hidden_states": False}).json()[
        "choices"][0]
    assert http.post("/v1/completions", json=body | {"max_tokens": 1}).json()["choices"][0]["hidden_states"] == []
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=1, extra_body={"return_hidden_states": True})
    assert refused.value.body["param"] == "return_hidden_states"


def test_token_id_keys_are_always_in_a_whole_choice(http):
    """vLLM basic/test_return_token_ids.py: a non-streamed choice always has `token_ids` and `prompt_token_ids`
    (`"prompt_token_ids" in choice`), null unless return_token_ids asks for them; streamed chunks carry them
    only when asked."""
    body = {"model": "demo", "prompt": "Hello", "max_tokens": 2}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    assert "token_ids" in plain and "prompt_token_ids" in plain
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None
    asked = http.post("/v1/completions", json=body | {"return_token_ids": True}).json()["choices"][0]
    assert len(asked["token_ids"]) == 2 and asked["prompt_token_ids"]
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks and all("token_ids" not in c["choices"][0] for c in chunks)
