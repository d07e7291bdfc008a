"""Agent frameworks end to end against a real `python -m minisgl --demo` server (issue 20): the OpenAI Agents
SDK through its default model (the Responses API) and instructor's tool and schema modes. The demo model is
random, so every answer is bounded by max tokens and only its shape is asserted; constrained decoding is what
makes a random model's structured output valid, and what makes it end within the bound (the Agents SDK takes an
incomplete response for a failure, so its agents answer with a structured `output_type`)."""

from __future__ import annotations

import asyncio
from typing import Literal

import agents
import instructor
import openai
import pytest
from pydantic import BaseModel
from server_fixtures import serving

MAX_TOKENS = 48


class Reading(BaseModel):
    """A small object with typed fields whose schema a random model can fill within a few tokens."""

    ok: bool
    unit: Literal["m", "s"]


@pytest.fixture(scope="module")
def server():
    with serving("--demo") as srv:
        yield srv


@pytest.fixture
def responses_model(server) -> agents.OpenAIResponsesModel:
    """The Agents SDK's default model class (the Responses API), pointed at the server; tracing off: no network.
    One per test: its async client's connections belong to the event loop of the test's `asyncio.run`."""
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return agents.OpenAIResponsesModel(model="demo", openai_client=client)


def agent(model: agents.OpenAIResponsesModel, **options) -> agents.Agent:
    return agents.Agent(name="demo", instructions="You are terse.", model=model, output_type=Reading,
                        model_settings=agents.ModelSettings(max_tokens=MAX_TOKENS, **options.pop("settings", {})),
                        **options)


def test_agents_sdk_plain_agent_returns_a_final_output(responses_model):
    result = asyncio.run(agents.Runner.run(agent(responses_model), "Give a reading.", max_turns=1))
    assert isinstance(result.final_output, Reading)
    [response] = result.raw_responses
    assert response.response_id.startswith("resp_") and 0 < response.usage.output_tokens <= MAX_TOKENS


def test_agents_sdk_streamed_run_yields_events_and_ends(responses_model):
    async def run() -> tuple[list, agents.RunResultStreaming]:
        streamed = agents.Runner.run_streamed(agent(responses_model), "Give a reading.", max_turns=1)
        return [event async for event in streamed.stream_events()], streamed

    events, streamed = asyncio.run(run())
    raw = [e.data.type for e in events if e.type == "raw_response_event"]
    assert raw[0] == "response.created" and raw[-1] == "response.completed"
    assert "response.output_text.delta" in raw
    assert streamed.is_complete and isinstance(streamed.final_output, Reading)
    text = "".join(e.data.delta for e in events if e.type == "raw_response_event"
                   and e.data.type == "response.output_text.delta")
    assert Reading.model_validate_json(text) == streamed.final_output


def test_agents_sdk_function_tool_agent_runs_the_tool(responses_model):
    calls: list[tuple[bool, str]] = []

    @agents.function_tool
    def record(ok: bool, unit: Literal["m", "s"]) -> str:
        """Record a reading."""
        calls.append((ok, unit))
        return f"recorded {ok} {unit}"

    tool_agent = agent(responses_model, tools=[record], settings={"tool_choice": "record"},
                       tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(agents.Runner.run(tool_agent, "Record a reading.", max_turns=2))
    [(ok, unit)] = calls
    assert isinstance(ok, bool) and unit in ("m", "s")
    assert result.final_output == f"recorded {ok} {unit}"


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.TOOLS_STRICT, instructor.Mode.JSON_SCHEMA,
                                  instructor.Mode.RESPONSES_TOOLS])
def test_instructor_mode_returns_a_valid_object(server, mode):
    client = instructor.from_openai(server.openai_client(), mode=mode)
    limit = {"max_output_tokens": MAX_TOKENS} if mode == instructor.Mode.RESPONSES_TOOLS else {
        "max_tokens": MAX_TOKENS}
    reading = client.create(model="demo", response_model=Reading, max_retries=0,
                            messages=[{"role": "user", "content": "Give a reading."}], **limit)
    assert isinstance(reading, Reading) and reading.unit in ("m", "s")
