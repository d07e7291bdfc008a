"""Plain data shared by every layer: sampling parameters, requests and batches."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]


@dataclass(frozen=True)
class Constraint:
    """A grammar the output must match (structured outputs): a JSON schema (as JSON text), any JSON
    object (`spec` empty), a regular expression, an EBNF grammar (xgrammar's dialect) or a structural tag
    (xgrammar's `format` object, as JSON text). Plain text,
    so that it pickles cheaply to every scheduler rank and keys the compiled-grammar cache."""

    kind: ConstraintKind
    spec: str = ""


@dataclass(frozen=True)
class ThinkingBudget:
    """vLLM's thinking_token_budget: once `budget` tokens follow the `start` marker of a thinking block (opened
    by the prompt or by the output) before its `end` marker, the whole `end` marker is forced next, token by
    token. A block the model closes itself is left alone. Markers are token ids, as the tokenizer spells them."""

    budget: int
    start: tuple[int, ...]
    end: tuple[int, ...]


MAX_MARKER_TOKENS = 16  # the longest thinking marker, in tokens
MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI allows
# Temperatures below this sample greedily, as vLLM's do: dividing float32 logits by them overflows to inf/NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling controls (the OpenAI / vLLM meanings).

    temperature 0 means greedy. `seed` makes sampling reproducible whatever else shares the batch.
    `logprobs` = N returns the chosen token's log-probability plus the top N alternatives
    (None: no logprobs at all; N at most the vocabulary: `check_request`); `prompt_logprobs` = N the same
    for every prompt token but the first (its prefill then skips the prefix cache: cached tokens have no
    logits). `constraint` restricts every sampled token to those its grammar allows. `logit_bias` is added
    to its tokens' logits first.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_temperature: float = 1.0  # the prompt's logprobs from logits / this (vLLM's)
    constraint: Constraint | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before anything else
    thinking_budget: ThinkingBudget | None = None  # end a thinking block after this many tokens (vLLM's)
    return_hidden_states: bool = False  # keep the final hidden state each token was sampled from (SGLang's)

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        def finite(name: str) -> bool:
            value = getattr(self, name)
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        def whole(name: str) -> bool:
            value = getattr(self, name)
            return isinstance(value, int) and not isinstance(value, bool)

        check(finite("temperature") and self.temperature >= 0, "temperature", "a number >= 0")
        check(finite("top_p") and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        check(whole("top_k") and (self.top_k == -1 or self.top_k >= 1), "top_k", "-1 (off) or >= 1")
        check(finite("min_p") and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        check(whole("max_tokens") and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        check(whole("min_tokens") and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              "an integer in [0, max_tokens]")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool")
        check(isinstance(self.stop_token_ids, (list, tuple))
              and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "a list of non-negative integers")
        check(self.seed is None or whole("seed"), "seed", "an integer or None")
        check(finite("presence_penalty") and -2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]")
        check(finite("frequency_penalty") and -2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]")
        check(finite("repetition_penalty") and self.repetition_penalty > 0, "repetition_penalty", "a number > 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (whole(name) and value >= 0), name, "None or an integer >= 0")
        check(finite("prompt_logprobs_temperature") and self.prompt_logprobs_temperature > 0,
              "prompt_logprobs_temperature", "a number > 0")
        check(self.constraint is None or isinstance(self.constraint, Constraint), "constraint",
              "None or a Constraint")
        check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS
                                          and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                  and isinstance(v, (int, float)) and -100 <= v <= 100
                                                  for t, v in self.logit_bias.items())),
              "logit_bias", f"None or at most {MAX_LOGIT_BIAS} token ids mapped to numbers in [-100, 100]")
        check(self.constraint is None or self.min_tokens == 0, "min_tokens",
              "0 with a constraint (the grammar alone decides where the output may end)")
        think = self.thinking_budget
        check(think is None or (isinstance(think, ThinkingBudget) and isinstance(think.budget, int)
                                and think.budget >= 0 and all(0 < len(m) <= MAX_MARKER_TOKENS and all(
                                    isinstance(t, int) for t in m) for m in (think.start, think.end))),
              "thinking_budget", f"None or a budget >= 0 with markers of 1 to {MAX_MARKER_TOKENS} token ids")
        check(isinstance(self.return_hidden_states, bool), "return_hidden_states", "a bool")
        check(think is None or self.constraint is None, "thinking_budget",
              "None with a constraint (the grammar decides every token)")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class ContextLengthError(ValueError):
    """A prompt too long for the context or the KV pool (OpenAI's `context_length_exceeded`)."""


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    """Refuse ids outside the vocabulary: one would index past the embedding or the sampler's rows."""
    if set(map(type, ids)) <= {int} and (not ids or (min(ids) >= 0 and max(ids) < vocab_size)):
        return  # all plain ints in range, checked at C speed: a long prompt is checked on the server's event loop
    for t in ids:
        if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size):
            raise ValueError(f"{field} must hold token ids in [0, {vocab_size}), got {t!r}: out of vocabulary")


def check_prompt(ids: list[int], vocab_size: int, max_seq_len: int, kv_capacity: int) -> None:
    """Refuse a prompt the engine cannot serve; both fronts (offline LLM, HTTP server) call this."""
    if not ids:
        raise ValueError("prompt is empty")
    check_token_ids(ids, vocab_size, "prompt")
    check_prompt_length(len(ids), max_seq_len, kv_capacity)


def check_prompt_length(num_tokens: int, max_seq_len: int, kv_capacity: int) -> None:
    """A prompt of `num_tokens` must leave room to generate, in the context and in the KV pool."""
    if num_tokens >= max_seq_len:
        # Worded so that clients matching vLLM's or SGLang's message ("maximum context length", "is longer
        # than the model's context length") recognise it.
        raise ContextLengthError(f"the prompt has {num_tokens} tokens and is longer than the model's context length: "
                                 f"this model's maximum context length is {max_seq_len} tokens, and a prompt "
                                 f"must leave room for at least one generated token")
    if num_tokens >= kv_capacity:
        raise ContextLengthError(f"the prompt has {num_tokens} tokens but the KV pool holds only {kv_capacity}")


def check_request(ids: list[int], params: SamplingParams, vocab_size: int, max_seq_len: int,
                  kv_capacity: int) -> None:
    """Everything about one request that depends on the model, checked before it reaches a scheduler
    (which would fail on it mid-batch): the prompt, and every token id the sampling parameters name."""
    check_prompt(ids, vocab_size, max_seq_len, kv_capacity)
    check_params(params, vocab_size)


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """The sampling parameters' side of `check_request`: the token ids they name, the logprob counts. Apart, so
    that a server checks a batch's shared parameters once and each prompt's ids once."""
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(list(params.logit_bias or {}), vocab_size, "logit_bias")
    if params.thinking_budget is not None:
        check_token_ids([*params.thinking_budget.start, *params.thinking_budget.end], vocab_size, "thinking_budget")
    for name in ("logprobs", "prompt_logprobs"):  # the top-N alternatives are N distinct tokens of the vocabulary
        if (getattr(params, name) or 0) > vocab_size:
            raise ValueError(f"{name} must be at most the vocabulary size {vocab_size}, got {getattr(params, name)}")


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages
    RUNNING = "running"  # holds a table row and pages (prefilling in chunks or decoding)
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives, as (token_id, logprob) pairs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Req:
    """One generation request as the scheduler sees it.

    `kv_len` counts the leading tokens whose K/V are in the pool (or being written by a step already
    on the device). A forward pass feeds tokens `kv_len .. kv_len + n - 1`; when that reaches
    `device_len` the last logits are sampled. Prefill, chunked prefill, prefix-cache extend, decode and
    recompute after retraction are all this one rule. `unseen_tokens` counts tokens sampled on the device
    that the host has not seen yet (overlap scheduling): they exist only in the engine's token table.
    """

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # resolved seed (random when the user gave none), identical on every TP rank
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (with prompt_logprobs)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    error: str | None = None  # set (with finish_reason "abort") when handling this request raised
    row: int = -1  # row in the page table while RUNNING
    pages: list[int] = field(default_factory=list)  # physical pages backing all_ids[:kv_len...]
    kv_len: int = 0
    unseen_tokens: int = 0
    queued_step: int = 0  # the scheduler's step count when it joined the waiting queue (Scheduler._order_waiting)
    stalls: int = 0  # stalls it was charged: decoding beside a whole budget or a cut burst (Scheduler._spend_stall)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (best over admissions)
    cache_handle: object = None  # the prefix-cache node locked for this request
    cache_salt: str | None = None  # requests share cached prefixes only with requests of the same salt (vLLM's)
    hidden_state: list[float] | None = None  # the last token's (return_hidden_states): the final norm's output

    @property
    def scores_prompt(self) -> bool:
        """It asked for prompt logprobs and some are still to compute."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (decode reads one token per step)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p: end - p]
        return self.prompt_ids[start:end] + self.output_ids[: max(0, end - p)]

    @property
    def seq_len(self) -> int:
        """Tokens the host knows."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def device_len(self) -> int:
        """Tokens the device knows: the host's plus those sampled and not yet seen."""
        return self.seq_len + self.unseen_tokens


@dataclass
class Batch:
    """What one forward pass computes: request i feeds `extend_lens[i]` tokens from position
    `kv_lens[i]`; the requests at indices `sampled` reach their device_len and get a new token."""

    reqs: list[Req]
    kv_lens: list[int]
    extend_lens: list[int]
    sampled: list[int]
    # (request index, first position, count): prompt positions whose next token's logprob is asked for
    scored: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens) and not self.scored

    @property
    def decodes(self) -> int:
        """The leading requests of one new token each: the step's decodes (the scheduler puts them first)."""
        return next((i for i, n in enumerate(self.extend_lens) if n != 1), len(self.extend_lens))

    @property
    def decode_kv_tokens(self) -> int:
        """The cached tokens the decodes read: what the step's decode part costs beside its tokens
        (engine/step_cost.py)."""
        return sum(self.kv_lens[:self.decodes])
