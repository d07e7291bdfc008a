"""Structured outputs: grammars checked at the boundary, masks applied by the sampler, matchers advanced by the
scheduler (with overlap scheduling, across TP ranks), and the tiny random model's gibberish forced into shape
through the real server and the real `openai` client."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch
import xgrammar as xgr
from helpers import make_llm, random_prompts
from server_fixtures import Server, pages_all_free, serving

from minisgl import SamplingParams
from minisgl.constrained import apply_bitmask, check
from minisgl.constrained.grammar import _grammar
from minisgl.core import Constraint, Req
from minisgl.engine.sampler import Sampler
from minisgl.messages import AbortReq, AddReq

# Strings are bounded by patterns, not maxLength: the random model emits byte sequences xgrammar takes for one
# character (overlong UTF-8, e.g. E0 90 BE) that decode to three U+FFFD, and would pass maxLength.
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin", "Rome"]},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                     "note": {"type": "string"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "address", "tags", "active"],
}
EMAIL = r"[a-z]{3,6}@example\.(com|org)"


# ---------------------------------------------------------------- grammars and masks, without a model


@pytest.mark.parametrize("constraint, words", [
    (Constraint("json_schema", '{"type": "foo"}'), 'Unsupported type "foo"'),
    (Constraint("json_schema", "[1]"), "should be an object"),
    (Constraint("regex", "(ab"), "parenthesis is not closed"),
    (Constraint("ebnf", "root ::= missing"), 'Rule "missing" is not defined'),
])
def test_a_bad_grammar_is_refused_with_xgrammars_reason_and_no_source_location(constraint, words):
    with pytest.raises(ValueError) as e:
        check(constraint)
    assert words in str(e.value) and ".cc:" not in str(e.value)


def raw_vocab_matcher(constraint: Constraint, vocab: list[bytes]) -> xgr.GrammarMatcher:
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[len(vocab) - 1])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(_grammar(constraint)))


def test_length_bounded_strings_take_characters_that_decode_as_one():
    """xgrammar 0.2.8 lets a maxLength string take raw U+0000-U+001F (invalid JSON); the bounds are rewritten,
    leaving out surrogates too (their UTF-8 bytes decode to three U+FFFD)."""
    schema = Constraint("json_schema", json.dumps({"type": "string", "minLength": 1, "maxLength": 3}))
    vocab = [b'"', b"a", b"\x1d", b"\xed\xa0\x80", "😀".encode(), b"<eos>"]
    matcher = raw_vocab_matcher(schema, vocab)
    assert matcher.accept_token(0) and not matcher.accept_token(2) and not matcher.accept_token(3)
    assert matcher.accept_token(4) and matcher.accept_token(1) and matcher.accept_token(1)  # an emoji is one
    assert not matcher.accept_token(1)  # a fourth character passes maxLength
    assert matcher.accept_token(0) and matcher.accept_token(5) and matcher.is_terminated()
    short = raw_vocab_matcher(schema, vocab)
    assert short.accept_token(0) and not short.accept_token(0)  # minLength holds


def unpacked(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] bool from a [B, ceil(vocab/32)] int32 bitmask: bit j of word i allows token 32 i + j."""
    token = torch.arange(vocab)
    return ((bitmask[:, token // 32].long() >> (token % 32)) & 1).bool()


@pytest.mark.parametrize("vocab", [64, 77])
def test_bitmask_masks_exactly_the_tokens_it_leaves_out(vocab):
    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    bitmask[2] = -1  # a free row
    logits = torch.randn(5, vocab, generator=gen)
    masked = logits.clone()
    apply_bitmask(masked, bitmask)
    allowed = unpacked(bitmask, vocab)
    assert torch.equal(masked, torch.where(allowed, logits, float("-inf")))
    assert torch.equal(masked[2], logits[2])


def test_sampler_draws_only_allowed_tokens_and_reports_raw_logprobs():
    vocab, rows = 96, 4
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.3, top_k=5)]
    sampler = Sampler(rows, vocab, "cpu")
    for row, p in enumerate(params):
        sampler.prepare_row(row, p, seed=row, prompt_ids=[1], output_ids=[], min_tokens_banned=[])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(rows, vocab, generator=gen)
        raw = torch.log_softmax(logits, -1)
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, 3), generator=gen, dtype=torch.int32)
        out = sampler.sample(logits, torch.arange(rows), top_n=2, bitmask=bitmask)
        allowed = unpacked(bitmask, vocab)
        assert allowed[torch.arange(rows), out.token_ids].all()
        assert out.token_ids[0] == torch.where(allowed[0], raw[0], float("-inf")).argmax()  # greedy: best allowed
        assert torch.allclose(out.logprobs, raw[torch.arange(rows), out.token_ids])


# ---------------------------------------------------------------- the scheduler, in process


@pytest.fixture(scope="module")
def llm(tiny_models):
    with make_llm(tiny_models["qwen3"], max_prefill_tokens=64) as engine:
        yield engine


def idle(llm) -> bool:
    stats = llm.stats()
    return not llm.scheduler.has_work and stats["free_pages"] + stats["evictable_pages"] == stats["total_pages"]


def test_constrained_and_free_requests_share_batches_with_overlap(llm):
    """Free requests give the same tokens beside constrained ones, with which they share overlapped steps."""
    prompts = random_prompts([5, 17, 9, 30, 12, 7], 500, seed=1)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompts[:3], free)
    email = SamplingParams(temperature=0.8, max_tokens=40, seed=3, constraint=Constraint("regex", EMAIL))
    mixed = llm.generate(prompts, [free] * 3 + [email] * 3)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    for out in mixed[3:]:
        assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.config.eos_token_ids
        assert jsonschema.Draft202012Validator({"pattern": f"^{EMAIL}$"}).is_valid(out.text)
    assert llm.scheduler.overlap and llm.scheduler.unread_step is None and idle(llm)


@pytest.mark.parametrize("extreme", [{"repetition_penalty": 5e-324}, {"repetition_penalty": 9.7e307},
                                     {"temperature": 1.7e308}, {"temperature": 1.2e-38}, {"top_p": 2.2e-309}])
def test_extreme_settings_leave_the_grammar_a_token(llm, extreme):
    """Found by schemathesis: settings that are 0 or inf in float32 turned logits into NaN or left every allowed
    token out; the sampler drew a token the grammar refused."""
    prompt = [15, 16, 17]
    email = SamplingParams(**{"temperature": 1.0, "seed": 1, "max_tokens": 30, "frequency_penalty": 1.7,
                              "presence_penalty": 2.0, **extreme}, constraint=Constraint("regex", EMAIL))
    [out] = llm.generate([prompt + list(range(30, 200))], email)
    assert out.finish_reason == "stop" and jsonschema.Draft202012Validator({"pattern": f"^{EMAIL}$"}).is_valid(
        out.text)
    empty = SamplingParams(max_tokens=4, constraint=Constraint("regex", ""), **extreme)
    [out] = llm.generate([prompt], empty)
    assert out.finish_reason == "stop" and out.token_ids[0] in llm.engine.config.eos_token_ids


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(llm):
    broken = SamplingParams(max_tokens=8, constraint=Constraint("regex", "(unclosed"))
    fine = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    failed, ok = llm.generate([[5, 6, 7], [5, 6, 7]], [broken, fine])
    assert failed.finish_reason == "abort" and failed.token_ids == []
    assert ok.finish_reason == "length" and len(ok.token_ids) == 8
    assert idle(llm) and not llm.scheduler.grammars.matchers and not llm.scheduler.grammars.compiling


def test_abort_while_the_grammar_compiles_leaves_nothing_behind(llm):
    scheduler = llm.scheduler
    req = Req(10_001, [5, 6, 7], SamplingParams(max_tokens=8, constraint=Constraint("json_object")), seed=0)
    scheduler.tick([AddReq(req)])
    assert req in scheduler.compiling or req.finish_reason is not None
    scheduler.tick([AbortReq(req.rid)])
    while scheduler.has_work:
        scheduler.tick([])
    assert req.finish_reason == "abort" and req.rid not in scheduler.reqs
    assert not scheduler.grammars.matchers and not scheduler.grammars.compiling and idle(llm)
    scheduler.take_outputs()


def test_tensor_parallel_ranks_follow_the_same_grammar(tiny_models, llm):
    prompts = random_prompts([6, 11, 4], 500, seed=2)
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=60, constraint=Constraint("json_schema",
                                                                                           json.dumps(NESTED)))
              for s in range(3)]
    one = llm.generate(prompts, params)
    with make_llm(tiny_models["qwen3"], tp_size=2, max_prefill_tokens=64) as tp2:
        two = tp2.generate(prompts, params)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]


# ---------------------------------------------------------------- the server, with the openai client


@pytest.fixture(scope="module")
def server(tiny_models):
    with serving(tiny_models["qwen3"]) as srv:
        yield srv


CHAT = [{"role": "user", "content": "Describe a person as JSON."}]


def outputs(client: openai.OpenAI, stream: bool, **kwargs) -> list[tuple[str, str]]:
    """(text, finish_reason) of every choice, streamed or whole."""
    resp = client.chat.completions.create(model="tiny", messages=CHAT, stream=stream, **kwargs)
    if not stream:
        return [(c.message.content, c.finish_reason) for c in resp.choices]
    texts, finish = {}, {}
    for chunk in resp:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    return [(texts[i], finish[i]) for i in sorted(texts)]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_forces_twenty_sampled_outputs_to_validate(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": NESTED, "strict": True}}
    outs = []
    for seed in (1, 100):
        outs += outputs(client, stream, n=10, seed=seed, temperature=1.0, max_tokens=300, response_format=fmt)
    assert len({text for text, _ in outs}) > 10  # really sampled, not one answer twenty times
    for text, finish in outs:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), NESTED)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_forces_twenty_sampled_outputs_to_be_objects(client, stream):
    outs = []
    for seed in (2, 200):
        outs += outputs(client, stream, n=10, seed=seed, temperature=1.0, max_tokens=400,
                        response_format={"type": "json_object"})
    for text, finish in outs:
        assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_regex_and_ebnf_on_text_completions(server):
    body = {"model": "tiny", "prompt": "Contact:", "max_tokens": 40, "n": 4, "seed": 5}
    emails = httpx.post(f"{server.url}/v1/completions", json=body | {"regex": EMAIL}, timeout=60).json()
    assert all(jsonschema.Draft202012Validator({"pattern": f"^{EMAIL}$"}).is_valid(c["text"])
               for c in emails["choices"]), emails
    ebnf = 'root ::= "yes" | "no" | "n/a (" [0-9] ")"'
    answers = httpx.post(f"{server.url}/v1/completions", json=body | {"ebnf": ebnf}, timeout=60).json()
    assert all(c["text"] in ("yes", "no") or c["text"][:5] == "n/a (" for c in answers["choices"]), answers
    assert {c["finish_reason"] for c in answers["choices"]} == {"stop"}


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", 'Unsupported type "foo"'),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex", "cannot be combined with response_format"),
    ({"regex": "(", "max_tokens": 3}, "regex", "parenthesis is not closed"),
    ({"ebnf": "root ::= nothing"}, "ebnf", "not defined"),
    ({"regex": "a+", "min_tokens": 2}, "min_tokens", "cannot be combined with regex"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
])
def test_grammars_that_cannot_be_followed_are_400s_naming_the_field(server, body, param, words):
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi"} | body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert words in resp.json()["error"]["message"]
    assert pages_all_free(server.info())


def test_response_format_text_is_free_text(client):
    free = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    text = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                          response_format={"type": "text"}, extra_body={"ignore_eos": True})
    assert text.choices[0].message.content == free.choices[0].message.content


def test_without_a_tokenizer_grammars_are_refused(tiny_models):
    srv = Server(tiny_models["qwen3"], "--skip-tokenizer-init")
    try:
        resp = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": [5, 6], "regex": "a+"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "regex"
        assert "tokenizer" in resp.json()["error"]["message"]
    finally:
        assert srv.stop() == 0
