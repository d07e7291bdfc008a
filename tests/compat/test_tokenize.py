"""POST /tokenize and GET /tokenizer_info as vLLM's test_tokenization drives them (and lm-evaluation-harness's
remote tokenizer): special tokens on request, token strings, tools shown by the chat template."""

from __future__ import annotations

import httpx

CHAT = [{"role": "user", "content": "What's the weather like in Paris today?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}}}}]


def test_add_special_tokens_and_token_strs(http, tokenizer):
    """vLLM test_tokenize_completions / _with_return_token_strs: ids as the tokenizer gives them with or
    without its special tokens, and each token's string when asked (null otherwise)."""
    prompt = "This is a token_strs test prompt!"
    for special in (False, True):
        answer = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": special}).json()
        assert answer["tokens"] == tokenizer.encode(prompt, add_special_tokens=special)
        assert answer["token_strs"] is None
    answer = http.post("/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])


def test_chat_with_tools_is_tokenized_as_the_template_shows_them(http, tokenizer):
    """vLLM test_tokenize_chat_with_tools: the tools are put through the chat template as on chat."""
    answer = http.post("/tokenize", json={"messages": CHAT, "tools": TOOLS}).json()
    text = tokenizer.apply_chat_template(CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert answer["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert answer["count"] > http.post("/tokenize", json={"messages": CHAT}).json()["count"]


def test_tokenizer_info_describes_the_served_tokenizer(http, tokenizer):
    """vLLM test_tokenizer_info_*: the tokenizer's class, special tokens, chat template and added tokens;
    lm-evaluation-harness reads it to tokenize through the server."""
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] and info["eos_token"] == tokenizer.eos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert info["added_tokens_decoder"][str(tokenizer.eos_token_id)] == {"content": tokenizer.eos_token,
                                                                         "special": True}
    assert info["model_max_length"] >= http.post("/tokenize", json={"prompt": "x"}).json()["max_model_len"]


def test_model_field_names_the_served_model(http):
    """vLLM's /tokenize and /detokenize bodies carry `model`: the served name is taken, another is a 404."""
    assert http.post("/tokenize", json={"model": "demo", "prompt": "hi"}).status_code == 200
    assert http.post("/detokenize", json={"model": "demo", "tokens": [1, 2]}).status_code == 200
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        answer = http.post(path, json=body | {"model": "other"})
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"


def test_special_tokens_by_default_as_vllm_has_them(bos_server, bos_tokenizer):
    """vLLM's /tokenize defaults: a prompt gets the tokenizer's special tokens (a BOS), as /v1/completions
    encodes it; messages do not (their template writes its own)."""
    url, bos = bos_server.url, bos_tokenizer.bos_token_id
    prompt = httpx.post(f"{url}/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    assert prompt == bos_tokenizer("Hello there").input_ids and prompt[0] == bos
    chat = httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert chat.count(bos) == 1 and chat == bos_tokenizer(bos_tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
