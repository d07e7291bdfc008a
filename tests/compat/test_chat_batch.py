"""POST /v1/chat/completions/batch (vLLM's): several conversations, one response, each choice the answer the
conversation gets alone."""

from __future__ import annotations

import json

import pytest

CONVERSATIONS = [[{"role": "user", "content": "Reply with exactly the word: alpha"}],
                 [{"role": "user", "content": "Reply with exactly the word: beta"}]]


def test_each_conversation_is_answered_as_alone(http):
    """vLLM test_batched_chat_completions: one choice per conversation, indexed by it, each (greedy) the very
    answer /v1/chat/completions gives that conversation; the usage counts every prompt."""
    body = {"model": "demo", "max_tokens": 5, "temperature": 0}
    batch = http.post("/v1/chat/completions/batch", json=body | {"messages": CONVERSATIONS}).json()
    alone = [http.post("/v1/chat/completions", json=body | {"messages": c}).json() for c in CONVERSATIONS]
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in batch["choices"]] == [a["choices"][0]["message"]["content"] for a in alone]
    assert batch["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)


def test_a_grammar_holds_for_every_conversation(http):
    """vLLM test_batched_chat_completions_with_json_schema."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}
    answer_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    answer = http.post("/v1/chat/completions/batch", json={"model": "demo", "messages": CONVERSATIONS,
                                                            "response_format": answer_format}).json()
    assert [json.loads(c["message"]["content"])["answer"] in ("yes", "no") for c in answer["choices"]] == [True, True]


@pytest.mark.parametrize("by_id", [False, True])
def test_logprob_tokens_are_text_unless_asked_as_ids(http, by_id):
    """vLLM test_batched_chat_completions_logprobs_not_token_id_placeholders / _return_tokens_as_token_ids:
    return_token_ids leaves logprob tokens as text; return_tokens_as_token_ids spells them `token_id:N`."""
    extra = {"return_tokens_as_token_ids": True} if by_id else {"return_token_ids": True}
    answer = http.post("/v1/chat/completions/batch", json={"model": "demo", "messages": CONVERSATIONS[:1],
                                                            "max_tokens": 4, "logprobs": True, "top_logprobs": 1,
                                                            **extra}).json()
    tokens = [entry["token"] for entry in answer["choices"][0]["logprobs"]["content"]]
    assert tokens and all(t.startswith("token_id:") == by_id for t in tokens)


def test_streaming_is_refused(http):
    answer = http.post("/v1/chat/completions/batch", json={"model": "demo", "messages": CONVERSATIONS, "stream": True})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stream"
