"""Reasoning split: the parser on scripted outputs split at every position, chained with tool calls, and
--reasoning-parser qwen3 through the real server (outputs scripted by a regex, or opened and closed by the
chat template through chat_template_kwargs)."""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers import splits
from server_fixtures import serving
from template_models import with_chat_template

from minisgl.server.parsers.output import ChoiceDelta, OutputParser, ToolUse
from minisgl.server.parsers.reasoning import ReasoningParser, Split
from minisgl.server.parsers.tools import ToolCall

OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"  # a template that starts the model thinking
CASES = [  # (prompt's end, output, reasoning, answer)
    ("<|im_start|>assistant\n", "<think>\nTwo and two.\n</think>\n\nIt is 4.", "\nTwo and two.\n", "It is 4."),
    ("", "  <think>a</think>b</think>c", "a", "b</think>c"),
    ("", "It is 4, no thinking.", "", "It is 4, no thinking."),
    ("", "<thinking> is a word", "", "<thinking> is a word"),
    ("", "<think>cut short by max_tok", "cut short by max_tok", ""),
    ("", "<think></think>", "", ""),
    (OPEN_PROMPT, "Two and two.\n</think>\n\n\nIt is 4.\n", "Two and two.\n", "It is 4.\n"),
    (OPEN_PROMPT, "no end", "no end", ""),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hi <think>", "", "Hi <think>"),  # closed in the prompt
]


def run(parser: ReasoningParser, pieces: list[str]) -> Split:
    out = Split()
    for piece in [*pieces, None]:
        split = parser.feed(piece) if piece is not None else parser.finish()
        out = Split(out.reasoning + split.reasoning, out.content + split.content)
    return out


@pytest.mark.parametrize("prompt, output, reasoning, answer", CASES)
def test_reasoning_split_however_the_stream_splits_it(prompt, output, reasoning, answer):
    for pieces in splits(output):
        assert run(ReasoningParser("qwen3", prompt), pieces) == Split(reasoning, answer), pieces


def test_reasoning_shows_as_soon_as_it_cannot_be_a_tag():
    parser = ReasoningParser("qwen3", "")
    assert parser.feed("<thi") == Split() and parser.feed("nk>Hmm, </th") == Split(reasoning="Hmm, ")
    assert parser.feed("is is not it") == Split(reasoning="</this is not it")
    assert parser.feed("</think>\n") == Split() and parser.feed("\nYes") == Split(content="Yes")


def test_reasoning_then_a_tool_call():
    output = '<think>The user wants the time.</think>\n\n<tool_call>\n{"name": "get_time"}\n</tool_call>'
    for pieces in splits(output):
        parser = OutputParser(ToolUse("auto", parser="hermes"), ReasoningParser("qwen3", ""))
        delta = ChoiceDelta()
        for piece in pieces:
            delta += parser.feed(piece)
        delta += parser.finish("stop")
        assert delta == ChoiceDelta("", [ToolCall("get_time", "{}")], "The user wants the time."), pieces


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    model = with_chat_template(tiny_models["qwen3"], tmp_path_factory.mktemp("think") / "qwen3-think")
    with serving(model, "--reasoning-parser", "qwen3") as srv:
        yield srv


ASK = [{"role": "user", "content": "What is 2 + 2?"}]


def answer(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of the first choice, streamed or whole."""
    resp = client.chat.completions.create(model="tiny", messages=ASK, stream=stream, **kwargs)
    if not stream:
        message = resp.choices[0].message
        return getattr(message, "reasoning_content", None), message.content
    reasoning, content = [], []
    for chunk in resp:
        for c in chunk.choices:
            reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
            content.append(c.delta.content or "")
    return "".join(reasoning) or None, "".join(content)


@pytest.mark.parametrize("stream", [False, True])
def test_think_block_becomes_reasoning_content(client, stream):
    regex = "<think>\nTwo and two make four[.]\n</think>\n\nIt is 4[.]"
    reasoning, content = answer(client, stream, max_tokens=120, extra_body={"regex": regex})
    assert (reasoning, content) == ("\nTwo and two make four.\n", "It is 4.")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_template_kwargs_open_and_close_the_thinking(client, stream):
    """force_thinking ends the prompt inside <think>: all the (random) output is reasoning; enable_thinking false
    closes the block in the prompt: all of it is the answer."""
    common = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    opened = answer(client, stream, **common | {"extra_body": common["extra_body"] | {
        "chat_template_kwargs": {"force_thinking": True}}})
    closed = answer(client, stream, **common | {"extra_body": common["extra_body"] | {
        "chat_template_kwargs": {"enable_thinking": False}}})
    assert opened[0] and not opened[1] and closed[0] is None and closed[1]


def test_chat_template_kwargs_may_not_reset_the_templates_own_arguments(server):
    for name in ("tools", "add_generation_prompt", "messages", "tokenize"):
        resp = httpx.post(f"{server.url}/v1/chat/completions", json={
            "model": "tiny", "messages": ASK, "chat_template_kwargs": {name: False}})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template_kwargs", resp.text
        assert name in resp.json()["error"]["message"]
