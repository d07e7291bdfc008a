"""One real `python -m minisgl --demo` server for the compatibility tests, and clients for it."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import Server
from transformers import AutoTokenizer


@pytest.fixture(scope="session")
def demo():
    srv = Server("--demo")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="session")
def client(demo) -> openai.OpenAI:
    return demo.openai_client()


@pytest.fixture(scope="session")
def http(demo):
    with httpx.Client(base_url=demo.url, timeout=60) as session:
        yield session


@pytest.fixture(scope="session")
def tokenizer(demo, http):
    """The served model's own tokenizer (--demo writes its checkpoint where /get_server_info says)."""
    return AutoTokenizer.from_pretrained(http.get("/get_server_info").json()["model"])
