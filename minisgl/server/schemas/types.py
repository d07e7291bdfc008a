"""Field types and shapes every API's schema is made of.

Requests are parsed as strictly as OpenAI parses them: no bool or string is coerced to a number, no
string to a bool, no NaN or Infinity, and text must be valid Unicode (a lone surrogate such as "\\ud800"
is refused, not passed on to fail in the tokenizer or the JSON encoder). Ranges are declared on the
fields, so openapi.json states them; what a schema cannot express (the vocabulary, the context length,
rules across fields) is checked in `boundary`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Generic, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
    computed_field,
)

from minisgl.core import MAX_LOGIT_BIAS

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


def _plain_token_ids(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Token-id prompts as clients send them, a list (or a batch of lists) of plain non-negative ints, taken at C
    speed; anything else goes through the field's own validation (same result, same errors). Why: that path calls
    a Python validator per id (3.0 taken as 3) and first tries the text members of the union, ~120 us for 640 ids
    on the API's event loop, where every running stream's next chunk waits behind it."""
    if type(value) is list and value:
        rows = value if type(value[0]) is list else (value,)
        if all(type(row) is list and row and set(map(type, row)) == {int} and min(row) >= 0 for row in rows):
            return value
    return handler(value)


PlainIdsFirst = WrapValidator(_plain_token_ids)  # on a prompt field that takes token ids
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



def omitted(value: Any) -> bool:
    """`exclude_if` for response fields that appear only when they hold something (extensions of a peer)."""
    return value is None


# Fields the choices of chat's and text completions' answers share (SGLang's and vLLM's extensions), declared once.
MatchedStop = Annotated[str | int | None, Field(description="SGLang's: the stop string or stop/EOS token id that "
                                                            "ended a 'stop' choice")]
HiddenStates = Annotated[list[float] | None, Field(exclude_if=omitted, description="SGLang's return_hidden_states "
                                                   "(streamed: in a chunk of its own after the choice's last)")]
OutputIds = Annotated[list[int] | None, Field(description="the output's token ids (return_token_ids; else null, as "
                                                          "vLLM has it)")]
NewIds = Annotated[list[int] | None, Field(exclude_if=omitted, description="a chunk's new ids (return_token_ids)")]
PromptIds = Annotated[list[int] | None, Field(description="the prompt's ids (return_token_ids; else null)")]
FirstPromptIds = Annotated[list[int] | None, Field(exclude_if=omitted, description="the prompt's ids, with the "
                                                                                   "first chunk (return_token_ids)")]


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


LogprobsT = TypeVar("LogprobsT", bound=BaseModel)


class Choice(BaseModel, Generic[LogprobsT]):
    """What every choice of chat's and text completions' answers and chunks holds besides its output (a message,
    a delta, a text: the subclass's field, after these); LogprobsT is the API's logprobs payload."""

    index: int
    logprobs: LogprobsT | None = None
    finish_reason: str | None = None


class AnswerChoice(Choice[LogprobsT], Generic[LogprobsT]):
    """A choice of a whole answer: `token_ids` always there (null unless asked for), as vLLM answers (its
    clients test for the key), and SGLang's extensions."""

    token_ids: OutputIds = None
    matched_stop: MatchedStop = None
    hidden_states: HiddenStates = None


ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class Envelope(BaseModel):
    """The head every response object shares, in OpenAI's field order; subclasses set id and object."""

    id: str
    object: str
    created: int = Field(default_factory=unix_now)
    model: str


class Choices(Envelope, Generic[ChoiceT]):
    """An answer or one of its chunks (chat, text completions): the head, the choices and the usage (a chunk's:
    null, the choice's so far, or the whole in the last one); subclasses set id and object."""

    choices: list[ChoiceT]
    usage: Usage | None = None


def new_id(prefix: str) -> Any:
    return Field(default_factory=lambda: f"{prefix}-{uuid.uuid4().hex}")

