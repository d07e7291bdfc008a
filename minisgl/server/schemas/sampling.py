"""The sampling fields every generation API shares, declared once: `CommonSampling` (Responses has these),
`SamplingFields` (chat, completions and /generate's sampling_params add the rest), and vLLM's and
SGLang's extensions of chat and text completions."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from minisgl.core import Constraint
from minisgl.server.errors import ApiError
from minisgl.server.schemas.types import (
    HIDDEN_STATES_MARK,
    MAX_N,
    MAX_STOP_STRINGS,
    SERVED_MODEL_MARK,
    THINKING_MARK,
    LogitBias,
    LogprobCount,
    NonEmptyText,
    StrictRequest,
    Text,
    TokenId,
    integer,
)


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


class CommonSampling(StrictRequest):
    """The fields every generation API has (Responses included), declared once."""

    # Optional, as vLLM and SGLang have it (OpenAI requires it): left out, the served model; null is refused.
    model: Text = Field(None, json_schema_extra={SERVED_MODEL_MARK: True})
    stream: bool = False
    seed: integer(ge=-(2**63), le=2**63 - 1) | None = Field(None, description="a 64-bit integer, as vLLM takes it")
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: Text | None = Field(None, description="the end user, written in the request's log line")
    top_k: integer(ge=-1) | None = Field(None, description="-1 or 0: off")
    repetition_penalty: float | None = Field(None, gt=0)

    def common_sampling(self) -> dict[str, Any]:
        """These fields as SamplingParams takes them (None: the default)."""
        return {name: getattr(self, name) for name in (
            "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty")} | {
            "top_k": -1 if self.top_k == 0 else self.top_k}  # 0 is vLLM's spelling of "off"


class SamplingFields(CommonSampling):
    """The fields chat and text completions (and /generate's sampling_params) share beyond the common ones:
    OpenAI's, then vLLM's and SGLang's extensions."""

    # max_tokens when the request leaves it out (lowered to what the context leaves); None: all of that room.
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None

    n: integer(ge=1, le=MAX_N) = 1
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    logit_bias: LogitBias | None = Field(
        None, description="token id (as a string) -> a number in [-100, 100] added to its logit before sampling "
                          "(logprobs stay those of the model)")
    min_p: float | None = Field(None, ge=0, le=1)
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

    def shared_sampling(self) -> dict[str, Any]:
        return self.common_sampling() | {name: getattr(self, name) for name in (
            "min_p", "min_tokens", "ignore_eos", "stop_token_ids")} | {
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

    def prompt_truncation(self) -> tuple[int, Literal["left", "right"]] | None:
        """(tokens each prompt keeps, -1: the context length; the side cut), or None when prompts are kept whole."""
        if self.truncate_prompt_tokens is None:
            if self.truncation_side is not None:
                raise ApiError(400, "truncation_side needs truncate_prompt_tokens", param="truncation_side")
            return None
        return self.truncate_prompt_tokens, self.truncation_side or "left"

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
