"""POST /invocations (vLLM's single route for hosts such as SageMaker): a chat or a text completion, told
apart by the body, answered exactly as /v1/chat/completions or /v1/completions answers it."""

from __future__ import annotations

import pytest

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "what is 1+1?"}], "max_completion_tokens": 5,
        "temperature": 0.0, "logprobs": False}
COMPLETION = {"model": "demo", "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0.0}


@pytest.mark.parametrize("route, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_invocations_answers_as_the_route_the_body_names(http, route, body):
    """vLLM test_invocations: the same keys and the same choices as the route itself."""
    direct, invoked = http.post(route, json=body), http.post("/invocations", json=body)
    assert direct.status_code == invoked.status_code == 200, invoked.text
    assert direct.json().keys() == invoked.json().keys()
    assert direct.json()["choices"] == invoked.json()["choices"]


def test_invocations_streams(http):
    events = http.post("/invocations", json=COMPLETION | {"stream": True}).text.split("\n\n")
    assert events[0].startswith("data: {") and "data: [DONE]" in events


@pytest.mark.parametrize("body, words", [
    ({"max_tokens": 3}, "`messages`"),
    (CHAT | {"prompt": "both"}, "not both"),
    (CHAT | {"temperature": -1}, "temperature"),
    (COMPLETION | {"bogus": 1}, "bogus: unknown parameter"),
])
def test_invocations_bad_bodies_are_400_as_on_the_routes(http, body, words):
    answer = http.post("/invocations", json=body)
    assert answer.status_code == 400 and words in answer.json()["error"]["message"], answer.text


def test_invocations_malformed_json_is_400(http):
    answer = http.post("/invocations", content=b"{not json", headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and "malformed JSON" in answer.json()["error"]["message"]
