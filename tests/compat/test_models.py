"""GET /v1/models, GET /v1/models/{id}, GET /version and GET /health, as the peers' suites call them."""

from __future__ import annotations

import openai
import pytest

import minisgl


def test_model_list_has_the_served_model_with_its_context(client, http):
    """SGLang test_model_list: exactly one model, with an integer max_model_len (the context)."""
    models = list(client.models.list())
    assert [m.id for m in models] == ["demo"]
    context = http.get("/get_server_info").json()["max_seq_len"]
    assert models[0].max_model_len == context and isinstance(context, int)


def test_retrieve_model_by_id(client):
    """SGLang test_retrieve_model: the card's id and root are the served name; OpenAI's model object."""
    card = client.models.retrieve("demo")
    assert (card.id, card.root, card.object, card.owned_by) == ("demo", "demo", "model", "minisgl")


def test_retrieve_unknown_model_is_404(client):
    """SGLang test_retrieve_model: an unknown id raises openai.NotFoundError, with OpenAI's error code."""
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("non-existent-model")
    assert caught.value.body["code"] == "model_not_found"


def test_retrieve_model_id_with_a_slash(http):
    """Hugging Face ids hold a slash (org/name): it is part of the id, not a path the server lacks."""
    response = http.get("/v1/models/org/other-model")
    assert response.status_code == 404 and "'org/other-model'" in response.json()["error"]["message"]


def test_version(http):
    """vLLM test_show_version: GET /version answers {"version": <the server's version>} and nothing else."""
    response = http.get("/version")
    assert response.status_code == 200 and response.json() == {"version": minisgl.__version__}


def test_health(http):
    """vLLM test_check_health: GET /health is 200 once the model is served."""
    assert http.get("/health").status_code == 200


def test_load_counts_what_is_in_flight(http):
    """vLLM test_server_load: GET /load is 0 when idle, 1 while one request generates, 0 once it is done. The answer
    is 2,000 tokens long, so that it still runs when /load is asked: 64 (vLLM's test) once finished first under a
    busy neighbour, the scheduler decoding on while the api process was slow to send the first chunk."""
    assert http.get("/load").json() == {"server_load": 0}
    body = {"model": "demo", "prompt": "Give me a long story", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # generating now
        during = http.get("/load").json()["server_load"]
        assert [line for line in lines if line][-1] == "data: [DONE]"  # read to its end: the request is over
    assert during == 1
    assert http.get("/load").json() == {"server_load": 0}

