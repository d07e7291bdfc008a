"""A request plan: what every API's route turns its request into, and all that the pipeline runs.

The boundary (boundary.py) checks a plan against the model; the pipeline (pipeline.py) runs it. Neither
knows which API the plan came from: each field says what is asked, in the client's spellings where an
error must name a field (`renamed`), so one pipeline serves chat, completions, /generate and Responses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from minisgl.core import Constraint
from minisgl.server.schemas.sampling import SamplingFields, VllmExtras
from minisgl.server.text import Conversation

PromptInput = Conversation | list[Conversation] | list[str] | list[list[int]]


@dataclass
class Output:
    """How the answer is given back: streamed or whole (or, Responses' background, generated behind), and
    the per-request options of its shape that the server's flags may also turn on."""

    stream: bool = False
    background: bool = False
    include_usage: bool = False  # a last chunk with the usage (stream_options.include_usage)
    continuous_usage: bool = False  # every chunk with its choice's usage so far
    tokens_as_ids: bool = False  # logprob tokens spelled `token_id:N` (vLLM's return_tokens_as_token_ids)
    hidden_states: bool = False  # SGLang's return_hidden_states


@dataclass
class Plan:
    """One generation request: its prompts, sampling values (SamplingParams' field names; None: the default;
    max_tokens as asked), the grammars asked for (each with the field asking) and the output options."""

    model: str | None
    prompt: PromptInput
    sampling: dict[str, Any]
    renamed: dict[str, str] = field(default_factory=dict)  # SamplingParams field -> the client's spelling
    default_max_tokens: int | None = None  # max_tokens left out: this (None: all the room the context leaves)
    constraints: list[tuple[str, Constraint]] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    n: int = 1
    user: str | None = None
    cache_salt: str | None = None
    logprob_counts: dict[str, int] = field(default_factory=dict)  # field -> alternatives asked (--max-logprobs)
    truncation: tuple[int, Literal["left", "right"]] | None = None  # (tokens kept, -1: the context; side cut)
    thinking_budget: int | None = None  # vLLM's thinking_token_budget (None or -1: none)
    special_tokens: bool = False  # text prompts encoded with the tokenizer's special tokens (a BOS)
    prompt_text: bool = False  # the answer shows the prompt as text (echo): token-id prompts are decoded
    output: Output = field(default_factory=Output)

    @property
    def prompts(self) -> int:
        """How many prompts: a batch's length, or one conversation."""
        return 1 if isinstance(self.prompt, Conversation) else len(self.prompt)


def sampling_plan(body: SamplingFields, prompt: PromptInput, sampling: dict[str, Any], **fields: Any) -> Plan:
    """The plan of a request with the shared sampling fields (chat, completions, /generate): those fields and
    `sampling` (this API's own, overriding), and the rest of the plan's `fields`."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return Plan(model=body.model, prompt=prompt, sampling=body.shared_sampling() | sampling, stop=stop, n=body.n,
                user=body.user, default_max_tokens=body.DEFAULT_MAX_TOKENS,
                output=Output(stream=body.stream, include_usage=body.include_usage,
                              continuous_usage=body.continuous_usage), **fields)


def vllm_plan(body: SamplingFields | VllmExtras, prompt: PromptInput, sampling: dict[str, Any],
              prompt_logprobs: int | None, hidden_states: bool, **fields: Any) -> Plan:
    """The plan of a request with vLLM's extensions too (chat, completions): `prompt_logprobs` the prompt's
    alternatives the engine is asked for (None: no scoring)."""
    plan = sampling_plan(body, prompt, sampling | body.prompt_scoring(prompt_logprobs)
                         | {"return_hidden_states": hidden_states}, cache_salt=body.cache_salt,
                         truncation=body.prompt_truncation(), thinking_budget=body.thinking_token_budget, **fields)
    plan.output.tokens_as_ids, plan.output.hidden_states = body.return_tokens_as_token_ids, hidden_states
    return plan
