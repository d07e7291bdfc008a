"""Nothing is ignored silently: every field of every generation request model is honoured (a probe through the
real server shows its effect) or refused with a 400 naming it, and a field no model declares is refused too.
A field added to a request model without a probe here fails `test_every_field_has_a_probe`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from server_fixtures import Server, serving
from template_models import with_bos_token, with_chat_template

from minisgl.server.schemas.chat import ChatCompletionRequest
from minisgl.server.schemas.completions import CompletionRequest
from minisgl.server.schemas.responses import ResponsesRequest

CHAT = [{"role": "user", "content": "Tell me a story about a robot."}]
PROMPT = "Once upon a time"
PREFILL = CHAT + [{"role": "assistant", "content": "Once upon a time"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
HOT = {"temperature": 2.0, "seed": 3}  # sampling that differs from greedy


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")  # a tokenizer with a BOS, so that add_special_tokens shows
    model = with_bos_token(with_chat_template(tiny_models["qwen3"], root / "qwen3"), root / "qwen3-bos")
    with serving(model, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                 "--enable-return-hidden-states") as srv:
        yield srv


class Front:
    """One generation route: send it the base request with some fields changed, and read the answer."""

    def __init__(self, server: Server, path: str, base: dict):
        self.server, self.path, self.base = server, path, base

    def send(self, **fields) -> httpx.Response:
        body = {k: v for k, v in (self.base | fields).items() if v is not None}
        return httpx.post(f"{self.server.url}{self.path}", json=body, timeout=120)

    def ok(self, **fields) -> dict:
        resp = self.send(**fields)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def text(self, **fields) -> str:
        answer = self.ok(**fields)
        if self.path == "/v1/responses":
            return "".join(part["text"] for item in answer["output"] if item["type"] == "message"
                           for part in item["content"])
        choice = answer["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]

    def usage(self, **fields) -> tuple[int, int]:
        usage = self.ok(**fields)["usage"]
        return usage.get("prompt_tokens", usage.get("input_tokens")), usage.get("completion_tokens",
                                                                                 usage.get("output_tokens"))

    def refused(self, field: str, **fields) -> bool:
        resp = self.send(**fields)
        return resp.status_code == 400 and resp.json()["error"]["param"] == field


def events(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]


# ---------------------------------------------------------------- the fields chat and text completions share


def shared_probes() -> dict:
    long = {"max_tokens": 16, "ignore_eos": True}
    longer = {"max_tokens": 64, "ignore_eos": True}  # long enough for greedy text to repeat itself
    return {
        "model": lambda f: f.send(model="other").status_code == 404,
        "n": lambda f: len(f.ok(n=3)["choices"]) == 3,
        "stream": lambda f: f.send(stream=True).headers["content-type"].startswith("text/event-stream"),
        "stream_options": lambda f: json.loads(events(f.send(stream=True, stream_options={
            "include_usage": True}))[-2])["usage"] and not json.loads(events(f.send(stream=True))[-2])["usage"],
        "stop": stop_probe,
        "seed": lambda f: f.text(**HOT, **long) == f.text(**HOT, **long) != f.text(**HOT | {"seed": 4}, **long),
        "temperature": lambda f: f.text(**HOT, **long) != f.text(**long),
        "top_p": lambda f: f.text(**HOT, top_p=1e-6, **long) == f.text(**long),
        "top_k": lambda f: f.text(**HOT, top_k=1, **long) == f.text(**long),
        "min_p": lambda f: f.text(**HOT, min_p=1.0, **long) == f.text(**long),
        "presence_penalty": lambda f: f.text(presence_penalty=2.0, **longer) != f.text(**longer),
        "frequency_penalty": lambda f: f.text(frequency_penalty=2.0, **longer) != f.text(**longer),
        "repetition_penalty": lambda f: f.text(repetition_penalty=3.0, **longer) != f.text(**longer),
        "logit_bias": bias_probe,
        "user": user_probe,
        "stop_token_ids": lambda f: f.ok(stop_token_ids=list(range(512)))["choices"][0]["finish_reason"] == "stop"
        and f.usage(stop_token_ids=list(range(512)))[1] == 1,
        "min_tokens": lambda f: f.usage(stop_token_ids=list(range(256, 512)))[1] < 6
        <= f.usage(stop_token_ids=list(range(256, 512)), min_tokens=6)[1],
        "ignore_eos": ignore_eos_probe,
        "response_format": lambda f: isinstance(json.loads(f.text(response_format={"type": "json_object"},
                                                                  max_tokens=300)), dict),
        "regex": lambda f: re.fullmatch("[0-9]{3}-[a-z]{2}", f.text(regex="[0-9]{3}-[a-z]{2}")) is not None,
        "ebnf": lambda f: f.text(ebnf='root ::= "yes" | "no"') in ("yes", "no"),
    }


def vllm_output_probes() -> dict:
    def prompt_logprobs(answer: dict) -> list | None:
        return answer["prompt_logprobs"] if "prompt_logprobs" in answer else answer["choices"][0]["prompt_logprobs"]

    def prompt_ids(answer: dict) -> list[int]:
        return answer["prompt_token_ids"] if "prompt_token_ids" in answer else answer["choices"][0]["prompt_token_ids"]

    def cut(f: Front, side: str) -> list[int]:
        return prompt_ids(f.ok(truncate_prompt_tokens=3, truncation_side=side, return_token_ids=True))

    return {
        "truncate_prompt_tokens": lambda f: f.usage(truncate_prompt_tokens=3)[0] == 3 < f.usage()[0],
        "truncation_side": lambda f: cut(f, "left") == prompt_ids(f.ok(return_token_ids=True))[-3:]
        and cut(f, "right") == prompt_ids(f.ok(return_token_ids=True))[:3],
        "prompt_logprobs": lambda f: prompt_logprobs(f.ok()) is None
        and len(prompt_logprobs(f.ok(prompt_logprobs=1))) == f.usage()[0],
        "prompt_logprobs_temperature": lambda f: prompt_logprobs(f.ok(
            prompt_logprobs=0, prompt_logprobs_temperature=0.2)) != prompt_logprobs(f.ok(prompt_logprobs=0))
        and f.refused("prompt_logprobs_temperature", prompt_logprobs_temperature=0.2),
        "cache_salt": salt_probe,
        "structured_outputs": lambda f: f.text(structured_outputs={"choice": ["red", "blue"]}, **HOT)
        in ("red", "blue"),
        "guided_json": lambda f: isinstance(json.loads(f.text(guided_json={"type": "object"}, max_tokens=300)), dict),
        "guided_regex": lambda f: re.fullmatch("[0-9]{3}", f.text(guided_regex="[0-9]{3}", **HOT)) is not None,
        "guided_choice": lambda f: f.text(guided_choice=["red", "blue"], **HOT) in ("red", "blue"),
        "guided_grammar": lambda f: f.text(guided_grammar='root ::= "yes" | "no"', **HOT) in ("yes", "no"),
        "return_token_ids": lambda f: len(f.ok(return_token_ids=True)["choices"][0]["token_ids"]) == f.usage()[1]
        and f.ok()["choices"][0].get("token_ids") is None,
        "return_tokens_as_token_ids": tokens_as_ids_probe,
        "thinking_token_budget": thinking_budget_probe,
        "return_hidden_states": hidden_states_probe,
    }


def hidden_states_probe(f: Front) -> bool:
    """SGLang's return_hidden_states: a choice gets `hidden_states`, one float per unit of the model's hidden size;
    not asked for, no such key."""
    config = Path(f.server.info()["model"]) / "config.json"
    asked = f.ok(return_hidden_states=True, max_tokens=3, ignore_eos=True)["choices"][0]["hidden_states"]
    return len(asked) == json.loads(config.read_text())["hidden_size"] and "hidden_states" not in f.ok()["choices"][0]


def thinking_budget_probe(f: Front) -> bool:
    """A prompt that opens a thinking block (`<think>` and a newline: 1 token in the block already) gets its end
    marker after 2 more tokens (the same 2 as without a budget), for a budget of 3; under a grammar the budget is
    a 400."""
    end = httpx.post(f"{f.server.url}/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()
    end = end["tokens"]
    opened = {"chat_template_kwargs": {"force_thinking": True}} if f.path.endswith("chat/completions") else {
        "prompt": "<think>\n"}

    def ids(**fields) -> list[int]:
        answer = f.ok(**opened, max_tokens=12, ignore_eos=True, return_token_ids=True, **fields)
        return answer["choices"][0]["token_ids"]

    budgeted = ids(thinking_token_budget=3)
    # Chat's prompt also gets vLLM's hint, as a system message of its own
    hint = {"messages": [{"role": "system", "content": "Think step by step and use fewer than 3 reasoning tokens "
                                                       "before the final answer."}, *CHAT]} if "chat" in f.path else {}
    return budgeted[2:2 + len(end)] == end and budgeted[:2] == ids(**hint)[:2] != end[:2] and f.refused(
        "thinking_token_budget", thinking_token_budget=3, regex="a+")


def tokens_as_ids_probe(f: Front) -> bool:
    """Logprobs tokens are spelled `token_id:N`, N the ids the answer's token_ids hold."""
    asked = {"logprobs": True} if f.path == "/v1/chat/completions" else {"logprobs": 1}
    choice = f.ok(return_tokens_as_token_ids=True, return_token_ids=True, **asked)["choices"][0]
    logprobs = choice["logprobs"]
    tokens = [t["token"] for t in logprobs["content"]] if "content" in logprobs else logprobs["tokens"]
    return tokens == [f"token_id:{i}" for i in choice["token_ids"]]


def salt_probe(f: Front) -> bool:
    """A salted request hits only the prefix cache its own salt filled."""
    def cached(salt: str) -> int:
        return f.ok(cache_salt=salt)["usage"]["prompt_tokens_details"]["cached_tokens"]

    salt = f"salt-{f.path}"
    return cached(salt) == 0 and cached(salt) > 0 and cached(f"{salt}-other") == 0


def bias_probe(f: Front) -> bool:
    """+100 on one token makes a greedy answer that token over and over; a bias outside the vocabulary is a 400."""
    ids = f.ok(logit_bias={"42": 100}, return_token_ids=True, max_tokens=4, ignore_eos=True)["choices"][0]["token_ids"]
    return ids == [42] * 4 and f.refused("logit_bias", logit_bias={"99999999": 1})


def stop_probe(f: Front) -> bool:
    text = f.text(max_tokens=16, ignore_eos=True)
    stop = text[4:6]
    return f.text(max_tokens=16, ignore_eos=True, stop=stop) == text[:text.index(stop)]


def store_probe(f: Front) -> bool:
    """Kept by default (GET /v1/responses/{id} finds it), not with store: false (404)."""
    def found(response_id: str) -> int:
        return httpx.get(f"{f.server.url}/v1/responses/{response_id}", timeout=60).status_code
    return found(f.ok()["id"]) == 200 and found(f.ok(store=False)["id"]) == 404


def user_probe(f: Front) -> bool:
    name = f"user-{f.path}"
    f.ok(user=name)
    return f"user={name!r}" in f.server.output()


def ignore_eos_probe(f: Front) -> bool:
    """A sampled answer that ends at an EOS (not at max_tokens) goes on to max_tokens with ignore_eos."""
    for seed in range(40):
        cut = f.ok(temperature=1.5, seed=seed, max_tokens=48)
        if cut["choices"][0]["finish_reason"] == "stop":
            full = f.ok(temperature=1.5, seed=seed, max_tokens=48, ignore_eos=True)
            return full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 48
    raise AssertionError("no seed ended at an EOS: choose other seeds")


def parallel_probe(f: Front) -> bool:
    def calls(parallel: bool) -> list[int]:
        answer = f.ok(tools=TOOLS, tool_choice="required", n=8, temperature=1.0, seed=11, max_tokens=1000,
                      parallel_tool_calls=parallel)
        return [len(c["message"]["tool_calls"]) for c in answer["choices"]]
    return max(calls(True)) > 1 and set(calls(False)) == {1}


THINKING = {"regex": "<think>\nTwo and two[.]\n</think>\n\nIt is 4[.]", "max_tokens": 40}  # a scripted thought


def reasoning_deltas(f: Front, **fields) -> int:
    """How many streamed deltas carry reasoning in a scripted thought."""
    return sum(bool(c["delta"].get("reasoning_content")) for e in events(f.send(stream=True, **THINKING, **fields))
               if e != "[DONE]" for c in json.loads(e)["choices"])


CHAT_PROBES = shared_probes() | vllm_output_probes() | {
    "messages": lambda f: f.usage(messages=CHAT * 2)[0] > f.usage()[0],
    "prompt_token_ids": lambda f: f.usage(messages=[], prompt_token_ids=[5, 6, 7])[0] == 3
    and f.refused("prompt_token_ids", prompt_token_ids=[5, 6, 7]),
    "max_tokens": lambda f: f.usage(max_tokens=3, ignore_eos=True)[1] == 3,
    "max_completion_tokens": lambda f: f.usage(max_tokens=5, max_completion_tokens=2, ignore_eos=True)[1] == 2,
    "logprobs": lambda f: f.ok(logprobs=True)["choices"][0]["logprobs"]["content"]
    and f.ok()["choices"][0]["logprobs"] is None,
    "top_logprobs": lambda f: all(len(t["top_logprobs"]) == 3 for t in f.ok(
        logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]),
    "tools": lambda f: f.usage(tools=TOOLS)[0] > f.usage()[0],
    "tool_choice": lambda f: f.ok(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                  max_tokens=50)["choices"][0]["message"]["tool_calls"][0]["function"]["name"]
    == "get_time",
    "parallel_tool_calls": parallel_probe,
    "chat_template_kwargs": lambda f: f.usage(chat_template_kwargs={"enable_thinking": False})[0] > f.usage()[0],
    "add_generation_prompt": lambda f: f.usage(add_generation_prompt=False)[0] < f.usage()[0],
    "continue_final_message": lambda f: f.usage(messages=PREFILL, continue_final_message=True)[0]
    < f.usage(messages=PREFILL)[0],
    "echo": lambda f: f.text(messages=PREFILL, continue_final_message=True, echo=True)
    == "Once upon a time" + f.text(messages=PREFILL, continue_final_message=True),
    "separate_reasoning": lambda f: f.text(**THINKING, separate_reasoning=False).startswith("<think>")
    and f.text(**THINKING) == "It is 4.",
    "include_reasoning": lambda f: f.ok(**THINKING, include_reasoning=False)["choices"][0]["message"][
        "reasoning_content"] is None and f.ok(**THINKING)["choices"][0]["message"]["reasoning_content"],
    "stream_reasoning": lambda f: reasoning_deltas(f, stream_reasoning=False) == 1 < reasoning_deltas(f),
    "add_special_tokens": lambda f: f.usage(add_special_tokens=True)[0] == f.usage()[0] + 1,  # a BOS on top
}


COMPLETION_PROBES = shared_probes() | vllm_output_probes() | {
    "prompt": lambda f: f.usage(prompt=PROMPT * 2)[0] > f.usage()[0],
    "max_tokens": lambda f: f.usage(max_tokens=3, ignore_eos=True)[1] == 3,
    "logprobs": lambda f: len(f.ok(logprobs=2, ignore_eos=True)["choices"][0]["logprobs"]["token_logprobs"]) == 8
    and f.ok()["choices"][0]["logprobs"] is None,
    "echo": lambda f: f.text(echo=True) == PROMPT + f.text(),
    "add_special_tokens": lambda f: f.usage(add_special_tokens=False)[0] == f.usage()[0] - 1,  # no BOS
}

RESPONSES_PROBES = {
    "model": lambda f: f.send(model="other").status_code == 404,
    "input": lambda f: f.usage(input=PROMPT * 2)[0] > f.usage()[0],
    "instructions": lambda f: f.usage(instructions="Be terse.")[0] > f.usage()[0],
    "max_output_tokens": lambda f: f.ok(max_output_tokens=3)["usage"]["output_tokens"] <= 3,
    "temperature": lambda f: f.text(temperature=2.0, max_output_tokens=16) != f.text(max_output_tokens=16),
    "top_p": lambda f: f.text(temperature=2.0, top_p=1e-6, max_output_tokens=16) == f.text(max_output_tokens=16),
    "stream": lambda f: f.send(stream=True).text.startswith("event: response.created"),
    "text": lambda f: isinstance(json.loads(f.text(text={"format": {"type": "json_object"}},
                                                   max_output_tokens=300)), dict),
    "store": store_probe,
    "background": lambda f: f.ok(background=True)["status"] == "queued",
    "previous_response_id": lambda f: f.usage(previous_response_id=f.ok()["id"])[0] > f.usage()[0],
    "metadata": lambda f: f.ok(metadata={"run": "42"})["metadata"] == {"run": "42"},
    "user": user_probe,
    "tools": lambda f: [item["name"] for item in f.ok(
        tools=[{"type": "function", **TOOLS[0]["function"]}], tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=50)["output"] if item["type"] == "function_call"] == ["get_time"],
    "reasoning": lambda f: f.usage(reasoning={"effort": "none"})[0] > f.usage()[0] == f.usage(
        reasoning={"effort": "high"})[0],
    "tool_choice": lambda f: f.text(tool_choice="auto") == f.text(tool_choice="none") == f.text()
    and f.refused("tool_choice", tool_choice="required"),
    "parallel_tool_calls": lambda f: f.ok(parallel_tool_calls=True)["parallel_tool_calls"] is True,
    "truncation": lambda f: f.ok(truncation="disabled")["truncation"] == "disabled"
    and f.refused("truncation", truncation="auto"),
    "seed": lambda f: f.text(**HOT, max_output_tokens=16) == f.text(**HOT, max_output_tokens=16)
    != f.text(**HOT | {"seed": 4}, max_output_tokens=16),
    "top_k": lambda f: f.text(**HOT, top_k=1, max_output_tokens=16) == f.text(max_output_tokens=16),
    "presence_penalty": lambda f: f.text(presence_penalty=2.0, max_output_tokens=64) != f.text(max_output_tokens=64),
    "frequency_penalty": lambda f: f.text(frequency_penalty=2.0, max_output_tokens=64)
    != f.text(max_output_tokens=64),
    "repetition_penalty": lambda f: f.text(repetition_penalty=3.0, max_output_tokens=64)
    != f.text(max_output_tokens=64),
    "include": lambda f: len(f.ok(include=["message.output_text.logprobs"])["output"][-1]["content"][0]["logprobs"])
    == f.usage()[1] and f.ok(include=["reasoning.encrypted_content"])["status"] in ("completed", "incomplete"),
    "top_logprobs": lambda f: {len(lp["top_logprobs"]) for lp in f.ok(
        include=["message.output_text.logprobs"], top_logprobs=3)["output"][-1]["content"][0]["logprobs"]} == {3}
    and f.refused("top_logprobs", top_logprobs=3),
}

FRONTS = {
    "chat": (ChatCompletionRequest, CHAT_PROBES, "/v1/chat/completions",
             {"model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0}),
    "completions": (CompletionRequest, COMPLETION_PROBES, "/v1/completions",
                    {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}),
    "responses": (ResponsesRequest, RESPONSES_PROBES, "/v1/responses",
                  {"model": "tiny", "input": PROMPT, "max_output_tokens": 8, "temperature": 0}),
}


@pytest.mark.parametrize("front", FRONTS)
def test_every_field_has_a_probe(front):
    model, probes, _, _ = FRONTS[front]
    assert set(model.model_fields) == set(probes)


@pytest.mark.parametrize("front, field", [(front, field) for front, (_, probes, _, _) in FRONTS.items()
                                          for field in probes])
def test_each_field_is_honoured_or_refused(server, front, field):
    _, probes, path, base = FRONTS[front]
    assert probes[field](Front(server, path, base))


@pytest.mark.parametrize("front", FRONTS)
def test_a_field_no_model_declares_is_refused_by_name(server, front):
    _, _, path, base = FRONTS[front]
    for unknown in ("suffix", "service_tier", "reasoning_effort", "conversation", "tools_choice"):
        resp = Front(server, path, base).send(**{unknown: "x"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == unknown, resp.text
        assert "unknown parameter" in resp.json()["error"]["message"]
