"""A model directory without a tokenizer. `--skip-tokenizer-init`: served as token ids in, token ids out,
through the real `openai` client; the offline LLM on the same directory is the oracle. `--tokenizer DIR`: the
tokenizer elsewhere, the one that every process loading a tokenizer loads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import DEVICE, make_llm, random_prompts
from server_fixtures import Server, serving

from minisgl import SamplingParams
from minisgl.core import Constraint
from minisgl.tokenizer import TokenizerSource

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def model(tiny_models, tmp_path_factory) -> str:
    """The tiny checkpoint with its tokenizer files deleted."""
    path = tmp_path_factory.mktemp("no-tokenizer") / "qwen3"
    shutil.copytree(tiny_models["qwen3"], path)
    for name in TOKENIZER_FILES:
        (path / name).unlink(missing_ok=True)
    return str(path)


@pytest.fixture(scope="module")
def server(model):
    with serving(model, "--skip-tokenizer-init") as srv:
        yield srv


def test_token_ids_in_token_ids_out_as_offline(client, model):
    prompts = random_prompts([5, 17, 30], 400, seed=3)
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    offline = make_llm(model).generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [c.token_ids for c in out.choices] == [o.token_ids for o in offline]
    assert all(c.text == "" for c in out.choices) and all(o.text is None for o in offline)
    first = out.choices[0]
    assert first.logprobs.tokens == [f"token_id:{t}" for t in first.token_ids]
    assert out.usage.prompt_tokens == sum(map(len, prompts)) and out.usage.completion_tokens == 36

    stream = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    streamed = [t for chunk in stream for c in chunk.choices for t in (c.token_ids or [])]
    assert streamed == offline[1].token_ids


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "tiny", "prompt": "hello"}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["hello", "there"]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2], "stop": "x"}, "stop"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/tokenize", {"prompt": "hello"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens"),
])
def test_text_gets_a_clear_400(server, path, body, param):
    resp = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param and "--skip-tokenizer-init" in error["message"]


def test_config_json_alone_with_dummy_weights(tiny_models, tmp_path):
    """What the benchmarks do with the real models' configs: no weights, no tokenizer."""
    (tmp_path / "config.json").write_bytes((Path(tiny_models["llama"]) / "config.json").read_bytes())
    cmd = [sys.executable, "-m", "minisgl", "--model", str(tmp_path), "--device", DEVICE, "--port", "1"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--skip-tokenizer-init" in refused.stderr
    srv = Server(str(tmp_path), "--skip-tokenizer-init", "--dummy-weight")
    try:
        body = {"model": "tiny", "prompt": [[1, 2, 3], [4]], "max_tokens": 5, "ignore_eos": True}
        choices = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["choices"]
        assert [len(c["token_ids"]) for c in choices] == [5, 5] and all(c["finish_reason"] == "length" for c in choices)
    finally:
        assert srv.stop() == 0


def test_echo_returns_the_prompt_ids_and_their_logprobs(client):
    prompt = random_prompts([9], 400, seed=5)[0]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=1, echo=True,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.token_ids[:9] == prompt and len(choice.token_ids) == 12 and choice.text == ""
    assert choice.logprobs.tokens[:9] == [f"token_id:{t}" for t in prompt]
    assert choice.logprobs.token_logprobs[0] is None and all(lp < 0 for lp in choice.logprobs.token_logprobs[1:])


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_models, tmp_path_factory) -> str:
    """The tiny checkpoint's tokenizer alone, in a directory of its own."""
    path = tmp_path_factory.mktemp("tokenizer")
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tiny_models["qwen3"]) / name, path / name)
    return str(path)


@pytest.fixture(scope="module")
def remote_code_tokenizer_dir(tokenizer_dir, tmp_path_factory) -> str:
    """That tokenizer as a class of its own code (tokenizer_config.json's auto_map): only --trust-remote-code
    loads it."""
    path = tmp_path_factory.mktemp("remote-code-tokenizer")
    shutil.copytree(tokenizer_dir, path, dirs_exist_ok=True)
    (path / "custom_tokenizer.py").write_text("from transformers import PreTrainedTokenizerFast\n\n\n"
                                              "class CustomTokenizerFast(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="CustomTokenizerFast",
                  auto_map={"AutoTokenizer": [None, "custom_tokenizer.CustomTokenizerFast"]})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


CODE = "[0-9]{3}-[a-z]{2}"  # a regex the output is held to: the scheduler's grammar compiler needs the tokenizer


def decoded(tokenizer_dir: str, ids: list[int]) -> str:
    return TokenizerSource(tokenizer_dir).load().decode(ids, skip_special_tokens=True)


def test_tokenizer_dir_is_the_one_every_server_process_loads(model, tokenizer_dir, remote_code_tokenizer_dir,
                                                             tmp_path):
    """The model directory has no tokenizer, so the api (/tokenizer_info, text prompts), the detokenizer (the
    text) and the grammar compiler (a regex) each answer only if it loads --tokenizer's, and only with
    --trust-remote-code (its code untrusted, the server refuses to start, saying so)."""
    cmd = [sys.executable, "-m", "minisgl", "--model", model, "--tokenizer", remote_code_tokenizer_dir,
           "--device", DEVICE, "--port", "1"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "trust_remote_code" in refused.stderr
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_MODULES_CACHE", str(tmp_path))  # where transformers copies the tokenizer's code
        srv = Server(model, "--tokenizer", remote_code_tokenizer_dir, "--trust-remote-code")
    try:
        assert httpx.get(f"{srv.url}/tokenizer_info").json()["tokenizer_class"] == "CustomTokenizerFast"
        out = srv.openai_client().completions.create(
            model="tiny", prompt="hello there", max_tokens=12, temperature=0,
            extra_body={"regex": CODE, "return_token_ids": True}).choices[0]
        assert re.fullmatch(CODE, out.text) and out.text == decoded(tokenizer_dir, out.token_ids)
    finally:
        assert srv.stop() == 0


def test_offline_llm_takes_a_tokenizer_dir(model, tokenizer_dir):
    """The offline LLM's tokenizer (text prompts, output text) and its grammar compiler load it too."""
    out = make_llm(model, tokenizer=tokenizer_dir).generate(
        "hello there", SamplingParams(temperature=0, max_tokens=12, constraint=Constraint("regex", CODE)))[0]
    assert re.fullmatch(CODE, out.text) and out.text == decoded(tokenizer_dir, out.token_ids)
