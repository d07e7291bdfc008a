"""Wire-format pieces every front shares: strict field types, the sampling fields of chat and text
completions, usage, the response envelope and the logprobs payloads.

Requests are parsed as strictly as OpenAI parses them: no bool or string is coerced to a number, no
string to a bool, no NaN or Infinity, and text must be valid Unicode (a lone surrogate such as "\\ud800"
is refused, not passed on to fail in the tokenizer or the JSON encoder). Ranges are declared on the
fields, so openapi.json states them; what a schema cannot express (the vocabulary, the context length,
rules across fields) is checked in `boundary`.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    WithJsonSchema,
    computed_field,
    field_validator,
)

from minisgl.core import MAX_LOGIT_BIAS, Constraint, ThinkingBudget
from minisgl.server.errors import ApiError
from minisgl.server.ipc import Alternative, LogprobEntry

MAX_N = 16
MAX_STOP_STRINGS = 16
# Marks on schema nodes that api.py fills in for this server: `maximum: vocab_size - 1` on a token id,
# `enum: [served model name]` on `model`, `maximum: the cap` on a count of logprob alternatives (--max-logprobs);
# a thinking budget only -1 without --reasoning-parser, return_hidden_states only false without its flag.
TOKEN_ID_MARK, SERVED_MODEL_MARK, LOGPROBS_MARK = "x-token-id", "x-served-model", "x-max-logprobs"
THINKING_MARK, HIDDEN_STATES_MARK = "x-thinking-budget", "x-hidden-states"


def _valid_unicode(text: str) -> str:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text must be valid Unicode; it holds a lone surrogate") from None
    return text


def _integral(value: Any) -> Any:
    # JSON Schema counts 3.0 as an integer, so clients and schema fuzzers may send it; 3.5, true, "3" stay refused.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, StringConstraints(min_length=1), AfterValidator(_valid_unicode)]


def integer(ge: int | None = None, le: int | None = None, **schema_extra: Any) -> Any:
    """An integer field's type: its bounds stated in the schema (they must come before the validator, or
    pydantic cannot express them there), and 3.0 taken as 3."""
    return Annotated[int, Field(ge=ge, le=le, json_schema_extra=schema_extra or None), BeforeValidator(_integral)]


TokenId = integer(ge=0, **{TOKEN_ID_MARK: True})
LogprobCount = integer(ge=0, **{LOGPROBS_MARK: True})  # at most the server's --max-logprobs (boundary checks it)


DIGITS = r"^[0-9]+$"
LogitBias = Annotated[
    dict[Annotated[str, StringConstraints(pattern=DIGITS)], Annotated[float, Field(ge=-100, le=100)]],
    Field(max_length=MAX_LOGIT_BIAS),
    WithJsonSchema({"type": "object", "additionalProperties": False, "maxProperties": MAX_LOGIT_BIAS,
                    "patternProperties": {DIGITS: {"type": "number", "minimum": -100, "maximum": 100}}})]


class StrictRequest(BaseModel):
    """Every field a request may have is declared, and honoured or refused: an unknown field is a 400
    naming it, never silently ignored (a client could not tell that it asked for nothing)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictRequest):
    include_usage: bool | None = Field(False, description="a last chunk with the usage and no choices")
    continuous_usage_stats: bool | None = Field(False, description="with include_usage (as vLLM has it): every "
                                                "chunk also carries its choice's usage so far")


class JsonSchemaSpec(StrictRequest):
    name: Text = Field(description="the schema's name (as OpenAI requires; it does not change the output)")
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = Field(None, description="outputs always match the schema; false is not weaker")


class TextFormat(StrictRequest):
    type: Literal["text"]


class JsonObjectFormat(StrictRequest):
    type: Literal["json_object"]


class JsonSchemaFormat(StrictRequest):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StructuralTagFormat(StrictRequest):
    """SGLang's and vLLM's structural tag, in xgrammar's form: `format` is one of its format objects
    (`const_string`, `json_schema`, `sequence`, `tag`, `triggered_tags`...), followed exactly."""

    type: Literal["structural_tag"]
    format: dict[str, Any] = Field(description="an xgrammar structural-tag format, e.g. {\"type\": \"const_string\", "
                                               "\"value\": \"...\"}")


AnyFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat | StructuralTagFormat
ResponseFormat = Annotated[AnyFormat, Field(discriminator="type")]


def response_format_constraint(fmt: AnyFormat | None) -> Constraint | None:
    if isinstance(fmt, JsonObjectFormat):
        return Constraint("json_object")
    if isinstance(fmt, JsonSchemaFormat):
        return Constraint("json_schema", json.dumps(fmt.json_schema.schema_))
    if isinstance(fmt, StructuralTagFormat):
        return Constraint("structural_tag", json.dumps(fmt.format))
    return None


class SamplingFields(StrictRequest):
    """The fields chat and text completions share: OpenAI's, then vLLM's and SGLang's extensions."""

    # max_tokens when the request leaves it out (lowered to what the context leaves); None: all of that room.
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None

    # Optional, as vLLM and SGLang have it (OpenAI requires it): left out, the served model; null is refused.
    model: Text = Field(None, json_schema_extra={SERVED_MODEL_MARK: True})
    n: integer(ge=1, le=MAX_N) = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: integer(ge=-(2**63), le=2**63 - 1) | None = Field(None, description="a 64-bit integer, as vLLM takes it")
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: LogitBias | None = Field(
        None, description="token id (as a string) -> a number in [-100, 100] added to its logit before sampling "
                          "(logprobs stay those of the model)")
    user: Text | None = Field(None, description="the end user, written in the request's log line")
    top_k: integer(ge=-1) | None = Field(None, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: integer(ge=0) | None = Field(None, description="at most max_tokens")
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema: the output "
                                                   "is forced to match (xgrammar)")
    regex: Text | None = Field(None, description="SGLang's extension: the output matches this regular expression")
    ebnf: Text | None = Field(None, description="SGLang's extension: the output matches this EBNF grammar "
                                                "(xgrammar's dialect, rule `root`)")

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        """vLLM and OpenAI refuse stream_options on a request that does not stream: it would be ignored."""
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream: true")
        return options

    def sampling(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The SamplingParams fields this request sets (None: the default), and for a field the request
        spells differently, that spelling (errors name what the client sent)."""
        raise NotImplementedError

    def wants_prompt_text(self) -> bool:
        """The answer shows the prompt as text (echo): token-id prompts are decoded for it."""
        return False

    def shared_sampling(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in (
            "temperature", "top_p", "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "seed",
            "presence_penalty", "frequency_penalty", "repetition_penalty")} | {
            "top_k": -1 if self.top_k == 0 else self.top_k,  # 0 is vLLM's spelling of "off"
            "logit_bias": {int(token): bias for token, bias in self.logit_bias.items()} if self.logit_bias else None}

    def constraints(self) -> list[tuple[str, Constraint]]:
        """The grammars this request asks for, each with the field that asks (at most one may)."""
        asked = [("response_format", response_format_constraint(self.response_format)),
                 ("regex", Constraint("regex", self.regex) if self.regex is not None else None),
                 ("ebnf", Constraint("ebnf", self.ebnf) if self.ebnf is not None else None)]
        return [(param, c) for param, c in asked if c is not None]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


def choice_constraint(choices: list[str]) -> Constraint:
    """The output is exactly one of `choices`: an EBNF of their literals (JSON's string escapes are EBNF's)."""
    return Constraint("ebnf", "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices))


def json_schema_constraint(schema: dict[str, Any] | str) -> Constraint:
    return Constraint("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


Choices = Annotated[list[Text], Field(min_length=1)]


class StructuredOutputs(StrictRequest):
    """vLLM's `structured_outputs`: one grammar for the output."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json", description="a JSON schema (object or text)")
    json_object: bool | None = Field(None, description="true: any JSON object")
    regex: Text | None = None
    choice: Choices | None = Field(None, description="the output is exactly one of these")
    grammar: Text | None = Field(None, description="EBNF in xgrammar's dialect (rule `root`)")

    def constraints(self) -> list[Constraint]:
        asked = [json_schema_constraint(self.json_) if self.json_ is not None else None,
                 Constraint("json_object") if self.json_object else None,
                 Constraint("regex", self.regex) if self.regex is not None else None,
                 choice_constraint(self.choice) if self.choice is not None else None,
                 Constraint("ebnf", self.grammar) if self.grammar is not None else None]
        return [c for c in asked if c is not None]


class VllmExtras(StrictRequest):
    """vLLM's extensions of chat and text completions beyond sampling."""

    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: the output matches one grammar")
    guided_json: dict[str, Any] | Text | None = Field(None, description="vLLM's older spelling of "
                                                      "structured_outputs.json")
    guided_regex: Text | None = Field(None, description="vLLM's older spelling of structured_outputs.regex")
    guided_choice: Choices | None = Field(None, description="vLLM's older spelling of structured_outputs.choice")
    guided_grammar: Text | None = Field(None, description="vLLM's older spelling of structured_outputs.grammar "
                                                          "(EBNF in xgrammar's dialect)")

    prompt_logprobs: LogprobCount | None = Field(
        None, description="vLLM's: every prompt token's logprob and the N best (the first token: null), keyed by "
                          "token id")
    prompt_logprobs_temperature: float | None = Field(
        None, gt=0, description="vLLM's: the prompt's logprobs (prompt_logprobs, echo's) from logits divided by this")
    return_token_ids: bool = Field(False, description="vLLM's: the prompt's and the output's token ids")
    return_tokens_as_token_ids: bool = Field(False, description="vLLM's: tokens in `logprobs` are spelled "
                                             "`token_id:N` (exact where a token is not text on its own)")
    cache_salt: NonEmptyText | None = Field(None, description="vLLM's: the request shares cached prompt prefixes "
                                            "only with requests of the same salt (tenants apart)")
    truncate_prompt_tokens: integer(ge=1) | Literal[-1] | None = Field(
        None, description="vLLM's: each prompt keeps only this many tokens (-1: the context length), cut on "
                          "truncation_side")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="vLLM's: left (the default) drops a long prompt's beginning, right its end")
    thinking_token_budget: integer(ge=-1, **{THINKING_MARK: True}) | None = Field(
        None, description="vLLM's: once a thinking block (the --reasoning-parser's markers) holds this many tokens, "
                          "its end marker is forced; -1: no budget")

    def thinking_budget(self, markers: tuple[tuple[int, ...], tuple[int, ...]] | None,
                        constrained: bool) -> ThinkingBudget | None:
        """The engine's ThinkingBudget for thinking_token_budget: it needs the reasoning parser's markers, and
        under a grammar (which decides every token) it could not be kept."""
        if self.thinking_token_budget in (None, -1):
            return None
        if markers is None:
            raise ApiError(400, "thinking_token_budget needs a server started with --reasoning-parser (its markers "
                                "delimit the thinking)", param="thinking_token_budget")
        if constrained:
            raise ApiError(400, "thinking_token_budget cannot be combined with structured outputs or a forced tool "
                                "choice: the grammar decides every token", param="thinking_token_budget")
        return ThinkingBudget(self.thinking_token_budget, *markers)

    def prompt_truncation(self, context: int) -> tuple[int, Literal["left", "right"]] | None:
        """(tokens each prompt keeps, the side cut), or None when prompts are kept whole."""
        if self.truncate_prompt_tokens is None:
            if self.truncation_side is not None:
                raise ApiError(400, "truncation_side needs truncate_prompt_tokens", param="truncation_side")
            return None
        keep = context if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return keep, self.truncation_side or "left"

    def prompt_scoring(self, asked: int | None) -> dict[str, Any]:
        """The engine's prompt-logprob settings: `asked` best tokens per position (None: no scoring), at the
        temperature asked for, which without scoring would change nothing: a 400 then."""
        if self.prompt_logprobs_temperature is not None and asked is None:
            raise ApiError(400, "prompt_logprobs_temperature needs prompt_logprobs (or echo with logprobs)",
                           param="prompt_logprobs_temperature")
        return {"prompt_logprobs": asked, "prompt_logprobs_temperature": self.prompt_logprobs_temperature or 1.0}

    def vllm_constraints(self) -> list[tuple[str, Constraint]]:
        """The grammars vLLM's fields ask for, each with the field that asks."""
        asked = [("structured_outputs", c) for c in (self.structured_outputs.constraints()
                                                     if self.structured_outputs else [])]
        asked += [("guided_json", json_schema_constraint(self.guided_json)) if self.guided_json is not None else None,
                  ("guided_regex", Constraint("regex", self.guided_regex)) if self.guided_regex is not None else None,
                  ("guided_choice", choice_constraint(self.guided_choice)) if self.guided_choice is not None else None,
                  ("guided_grammar", Constraint("ebnf", self.guided_grammar)) if self.guided_grammar is not None
                  else None]
        return [asked_by for asked_by in asked if asked_by is not None]


class HiddenStatesOption(StrictRequest):
    """SGLang's return_hidden_states, on chat and text completions (the server must be started with
    --enable-return-hidden-states, as SGLang's)."""

    return_hidden_states: bool = Field(False, json_schema_extra={HIDDEN_STATES_MARK: True},
                                       description="SGLang's: each choice also has `hidden_states`, the final "
                                       "hidden state (after the last norm) its last token was sampled from")


# ---------------------------------------------------------------- responses


def omitted(value: Any) -> bool:
    """`exclude_if` for response fields that appear only when they hold something (extensions of a peer)."""
    return value is None


def unix_now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @computed_field
    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @computed_field(description="vLLM's name for prompt_tokens_details.cached_tokens")
    @property
    def cache_read_input_tokens(self) -> int:
        return self.prompt_tokens_details.cached_tokens


class Envelope(BaseModel):
    """The head every response object shares, in OpenAI's field order; subclasses set id and object."""

    id: str
    object: str
    created: int = Field(default_factory=unix_now)
    model: str


def new_id(prefix: str) -> Any:
    return Field(default_factory=lambda: f"{prefix}-{uuid.uuid4().hex}")


# ---------------------------------------------------------------- logprobs payloads


def _lp(value: float) -> float:
    # JSON has no -inf (Starlette refuses to encode it); a masked-out alternative gets a floor instead.
    return value if math.isfinite(value) else -9999.0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def by_id(token: LogprobEntry | Alternative) -> str:
    """A token spelled by its id, as vLLM's return_tokens_as_token_ids has it (a token that is not text on
    its own, such as part of a UTF-8 character, stays exact)."""
    return f"token_id:{token.token_id}"


def chat_logprobs(entries: list[LogprobEntry], spell_by_id: bool = False) -> ChatLogprobs:
    """The chat `logprobs` object: per token its logprob, UTF-8 bytes and top alternatives."""

    def item(token: LogprobEntry | Alternative) -> dict:
        text = by_id(token) if spell_by_id else token.text
        return {"token": text, "logprob": _lp(token.logprob), "bytes": list(text.encode("utf-8"))}

    return ChatLogprobs(content=[TokenLogprob(**item(e), top_logprobs=[TopLogprob(**item(alt)) for alt in e.top])
                                 for e in entries])


def completion_logprobs(entries: list[LogprobEntry], text_offset_start: int = 0,
                        spell_by_id: bool = False) -> CompletionLogprobs:
    """The legacy completions `logprobs` object; `text_offset` counts characters into the returned text.
    An entry whose logprob is None (an echoed prompt's first token) has None for its top alternatives too."""
    offsets, pos = [], text_offset_start
    for e in entries:
        offsets.append(pos)
        pos += len(e.text)
    return CompletionLogprobs(
        tokens=[by_id(e) if spell_by_id else e.text for e in entries],
        token_logprobs=[None if e.logprob is None else _lp(e.logprob) for e in entries],
        top_logprobs=[None if e.logprob is None else completion_top(e, spell_by_id) for e in entries],
        text_offset=offsets)


class VllmLogprob(BaseModel):
    logprob: float
    rank: int | None  # among the top N (1 the best); null for a prompt token outside them
    decoded_token: str


PromptLogprobs = list[dict[str, VllmLogprob] | None]


def vllm_prompt_logprobs(entries: list[LogprobEntry]) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per position the token itself and the
    N best, keyed by token id."""
    positions: PromptLogprobs = [None]
    for e in entries:
        ranked = {alt.token_id: (rank, alt) for rank, alt in enumerate(e.top, 1)}
        position = {str(e.token_id): VllmLogprob(logprob=_lp(e.logprob), rank=ranked.get(e.token_id, (None,))[0],
                                                 decoded_token=e.text)}
        for token_id, (rank, alt) in ranked.items():
            position.setdefault(str(token_id), VllmLogprob(logprob=_lp(alt.logprob), rank=rank, decoded_token=alt.text))
        positions.append(position)
    return positions


def completion_top(entry: LogprobEntry, spell_by_id: bool = False) -> dict[str, float]:
    """A position's `top_logprobs`, as vLLM gives it: the token itself, then the top alternatives (N + 1 keys
    when it is not among them). Keys are texts (or ids, `spell_by_id`), so a second token of an already-listed
    text is keyed by its id (`token_id:N`, vLLM's spelling) instead of overwriting the first."""
    top = {by_id(entry) if spell_by_id else entry.text: _lp(entry.logprob)}
    for alt in entry.top:
        if alt.token_id != entry.token_id:
            top[alt.text if alt.text not in top and not spell_by_id else by_id(alt)] = _lp(alt.logprob)
    return top
