"""The one validation boundary: every route's request plan (plan.py) becomes a `CheckedRequest` here, and
nothing reaches a scheduler that was not checked here.

The schemas (schemas/) settle types and ranges. This module checks what
needs the model or the whole request: prompts tokenized (off the event loop) and fitting the context,
every token id against the vocabulary, the sampling parameters together (`SamplingParams`, then
`core.check_prompt` per prompt and `core.check_params` once: the very checks the offline `LLM` API runs,
none twice). A refusal is an `ApiError` 400 naming the request field as the client spelled it.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from minisgl.constrained import check as check_constraint
from minisgl.core import (
    Constraint,
    ContextLengthError,
    SamplingParams,
    ThinkingBudget,
    check_params,
    check_prompt,
    check_prompt_length,
)
from minisgl.server.errors import ApiError
from minisgl.server.plan import Plan, PromptInput
from minisgl.server.text import Conversation, TextCodec


@dataclass
class ModelLimits:
    """What the served model accepts (reported by the scheduler once it is ready)."""

    vocab_size: int
    max_seq_len: int
    kv_capacity: int
    max_logprobs: int = 20  # alternatives per token a request may ask for: --max-logprobs, at most the vocabulary
    thinking_markers: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # the reasoning parser's, as token ids


@dataclass
class CheckedRequest:
    """A plan once checked: token-id prompts and one SamplingParams for all of them (`max_tokens` already
    fitted to the room the longest prompt leaves)."""

    prompts: list[list[int]]
    prompt_texts: list[str | None]  # the text each prompt was made of (a chat: the template's), None for ids
    params: SamplingParams
    stop: list[str]  # matched on the decoded text by the detokenizer
    n: int
    seed: int | None
    cache_salt: str | None = None


async def prepare(codec: TextCodec, limits: ModelLimits, plan: Plan) -> CheckedRequest:
    prompt = plan.prompt
    prompt_param = "messages" if is_chat(prompt) else "prompt"
    check_logprobs(plan.logprob_counts, limits.max_logprobs)
    values, renamed = dict(plan.sampling), plan.renamed
    truncation = None
    if plan.truncation is not None:
        keep, side = plan.truncation
        truncation = (limits.max_seq_len if keep == -1 else keep, side)
    values["thinking_budget"] = thinking_budget(plan.thinking_budget, limits.thinking_markers,
                                                bool(plan.constraints))
    encoded = await encode(codec, limits, prompt, whole=truncation is not None, special=plan.special_tokens)
    if truncation is not None:
        encoded = [await truncated(codec, ids, text, *truncation) for _, ids, text in encoded]
    with refusals_named(prompt_param, renamed):
        for count, ids, _ in encoded:  # the prompts first: they decide the room left for max_tokens
            check_prompt_length(count, limits.max_seq_len, limits.kv_capacity)  # a text too long has no ids
            check_prompt(ids, limits.vocab_size, limits.max_seq_len, limits.kv_capacity)
        prompts = [ids for _, ids, _ in encoded]
        longest = max(len(ids) for ids in prompts)
        room = limits.max_seq_len - longest
        values["max_tokens"] = fitted_max_tokens(values.pop("max_tokens", None), plan.default_max_tokens, room,
                                                 longest, limits.max_seq_len, renamed.get("max_tokens", "max_tokens"),
                                                 chat=prompt_param == "messages")
        # Left out, max_tokens is what the context leaves: min_tokens is lowered the same way.
        values["min_tokens"] = min(values.get("min_tokens") or 0, room)
        params = SamplingParams(**{k: v for k, v in values.items() if v is not None})
        if plan.constraints and params.min_tokens:
            raise ValueError(f"min_tokens cannot be combined with {plan.constraints[0][0]}: the grammar alone "
                             f"decides where the output may end")
        check_params(params, limits.vocab_size)  # the prompts' ids were checked above
    params.constraint = await constraint(codec, plan.constraints)
    if plan.stop:
        codec.require("stop", "stop strings are matched on text; use stop_token_ids")
    texts = [text for _, _, text in encoded]
    if plan.prompt_text and codec.tokenizer is not None:
        texts = [text if text is not None else await codec.decode(ids) for text, ids in zip(texts, prompts)]
    return CheckedRequest(prompts, texts, params, plan.stop, plan.n, values.get("seed"), plan.cache_salt)


def thinking_budget(budget: int | None, markers: tuple[tuple[int, ...], tuple[int, ...]] | None,
                    constrained: bool) -> ThinkingBudget | None:
    """The engine's ThinkingBudget for vLLM's thinking_token_budget: it needs the reasoning parser's markers,
    and under a grammar (which decides every token) it could not be kept."""
    if budget in (None, -1):
        return None
    if markers is None:
        raise ApiError(400, "thinking_token_budget needs a server started with --reasoning-parser (its markers "
                            "delimit the thinking)", param="thinking_token_budget")
    if constrained:
        raise ApiError(400, "thinking_token_budget cannot be combined with structured outputs or a forced tool "
                            "choice: the grammar decides every token", param="thinking_token_budget")
    return ThinkingBudget(budget, *markers)


def check_logprobs(counts: dict[str, int], cap: int) -> None:
    """A count of alternatives over the server's cap is refused as the schema refuses a number over its bound
    (pydantic's words and code, which vLLM's messages carry), naming the cap."""
    for name, value in counts.items():
        if value > cap:
            raise ApiError(400, f"{name}: Input should be less than or equal to {cap}, this server's --max-logprobs "
                                f"(less_than_equal)", param=name, code="less_than_equal")


def fitted_max_tokens(requested: int | None, default: int | None, room: int, prompt_tokens: int, context: int,
                      param: str, chat: bool = False) -> int:
    """The request's max_tokens: left out, its default (or all the room there is) lowered to what the context
    leaves; asked for beyond that room, a 400 as vLLM and SGLang answer (prompt + max_tokens > context),
    worded so that clients matching either peer's message recognise it (a chat's limit, whichever field set
    it, in SGLang's words: "max_completion_tokens is too large")."""
    if requested is None:
        return min(default or room, room)
    if requested > room:
        limit = "max_completion_tokens" if chat and param in ("max_tokens", "max_completion_tokens") else f"'{param}'"
        raise ApiError(400, f"{limit} is too large: {requested}. This model's maximum context length is {context} "
                            f"tokens and your request has {prompt_tokens} input tokens ({requested} > {context} - "
                            f"{prompt_tokens}). Requested token count exceeds the model's maximum context length of "
                            f"{context} tokens: reduce the input or {param}.",
                       param=param, code="context_length_exceeded")
    return requested


@contextmanager
def refusals_named(prompt_param: str, renamed: dict[str, str]) -> Iterator[None]:
    """The core checks' ValueErrors (their message starts with the field) as 400s naming the request's field."""
    try:
        yield
    except ContextLengthError as exc:
        raise ApiError(400, str(exc), param=prompt_param, code="context_length_exceeded") from None
    except ValueError as exc:
        field, _, rest = str(exc).partition(" ")
        param = prompt_param if field == "prompt" else renamed.get(field, field)
        raise ApiError(400, f"{param} {rest}", param=param) from None


def is_chat(prompt: PromptInput) -> bool:
    """A conversation, or several (a batch of chats), rather than texts or token ids."""
    return isinstance(prompt, Conversation) or bool(prompt) and isinstance(prompt[0], Conversation)


async def encode(codec: TextCodec, limits: ModelLimits, prompt: PromptInput, whole: bool = False,
                 special: bool = False) -> list[tuple[int, list[int], str | None]]:
    """(token count, ids, text) of every prompt; text is tokenized off the loop (with the tokenizer's special
    tokens when `special`; token ids are taken as they are), and the ids of a text too long for the context are
    never built (left empty) unless `whole` (it is to be truncated)."""
    limit = math.inf if whole else limits.max_seq_len
    if is_chat(prompt):
        codec.require("messages", "chat needs a tokenizer and a chat template; send token ids to /v1/completions")
        return [await codec.encode_chat(c, limit, special)
                for c in ([prompt] if isinstance(prompt, Conversation) else prompt)]
    if prompt and isinstance(prompt[0], str):
        codec.require("prompt", "send the prompt as token ids")
        return [(*await codec.encode(text, limit, special), text) for text in prompt]
    return [(len(ids), ids, None) for ids in prompt]


async def truncated(codec: TextCodec, ids: list[int], text: str | None, keep: int, side: str
                    ) -> tuple[int, list[int], str | None]:
    """vLLM's truncate_prompt_tokens: a prompt longer than `keep` tokens loses its beginning (left) or its end
    (right); the text shown for it (echo, a reasoning block the prompt opened) is then the kept tokens'."""
    if len(ids) <= keep:
        return len(ids), ids, text
    kept = ids[-keep:] if side == "left" else ids[:keep]
    return keep, kept, await codec.decode(kept) if text is not None else None


async def constraint(codec: TextCodec, asked: list[tuple[str, Constraint]]) -> Constraint | None:
    """The request's grammar, parsed (off the loop) so that a bad one is a 400 naming its field."""
    if not asked:
        return None
    (param, grammar), *others = asked
    if others:
        raise ApiError(400, f"{others[0][0]} cannot be combined with {param}: the output can match only one grammar",
                       param=others[0][0])
    codec.require(param, "structured outputs need the model's tokenizer")
    try:
        await codec.run(check_constraint, grammar)
    except ValueError as exc:
        # A forced tool choice's grammar is the tools' parameter schemas: say so, in SGLang's words.
        message = (f"tool_choice forces calls, but a tool has an invalid 'parameters' schema: {exc}"
                   if param == "tool_choice" else f"{param} is not a grammar this server can follow: {exc}")
        raise ApiError(400, message, param=param) from None
    return grammar
