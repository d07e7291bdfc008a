"""One real `python -m minisgl --demo` server for the compatibility tests, and clients for it; and a server
whose tokenizer begins texts with a BOS, as Llama 3's does (the demo's never adds one)."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_fixtures import Server
from template_models import with_bos_token
from transformers import AutoTokenizer


@pytest.fixture(scope="session")
def demo():
    # A pool of 65,536 tokens (32 MiB for the demo model): room for generations long enough that a test can
    # still catch them running after a few HTTP round trips on a loaded machine.
    srv = Server("--demo", "--num-pages", "65536")
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


@pytest.fixture(scope="session")
def bos_model(tiny_models, tmp_path_factory) -> str:
    """A tiny llama whose tokenizer puts its BOS before an encoded text and whose chat template writes it first."""
    return with_bos_token(tiny_models["llama"], tmp_path_factory.mktemp("bos") / "llama", template_writes_it=True)


@pytest.fixture(scope="session")
def bos_server(bos_model):
    srv = Server(bos_model, "--enable-return-hidden-states")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="session")
def bos_tokenizer(bos_model):
    return AutoTokenizer.from_pretrained(bos_model)
