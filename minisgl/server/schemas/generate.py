"""SGLang's native /generate API's wire schemas: the body, its sampling_params, and each sequence's output."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, WithJsonSchema, model_validator
from pydantic.json_schema import SkipJsonSchema

from minisgl.core import Constraint
from minisgl.server.schemas.completions import TokenIds
from minisgl.server.schemas.sampling import SamplingFields, json_schema_constraint
from minisgl.server.schemas.types import (
    SERVED_MODEL_MARK,
    NonEmptyText,
    PlainIdsFirst,
    StrictRequest,
    Text,
    integer,
    omitted,
)

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
# Fields of SamplingFields that belong to a request's top level, not to sampling_params.
TOP_LEVEL_ONLY = ("model", "stream", "stream_options", "user")
# Request fields SGLang serves and this server does not: refused, as ignoring them would change the answer (the
# logprob fields' no-op values, which SGLang's clients send, are declared below and taken).
NOT_SERVED = ("return_logprob", "top_logprobs_num", "image_data", "lora_path", "input_embeds", "return_hidden_states")
# Our field name -> SGLang's, for errors that name what the client sent.
SGLANG_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed"}


class NativeSamplingParams(SamplingFields):
    """SGLang's `sampling_params`: the sampling fields every front shares, under SGLang's names for the
    lengths and the seed; `regex`, `ebnf` and `json_schema` constrain the output as on the OpenAI fronts.
    Unknown names are refused (SGLang's own constructor refuses them too), never silently ignored."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    # Top-level fields of SamplingFields, kept out of this schema: the route fills them in, a client may not.
    model: SkipJsonSchema[Text | None] = None
    stream: SkipJsonSchema[bool] = False
    stream_options: SkipJsonSchema[None] = None
    user: SkipJsonSchema[None] = None
    DEFAULT_MAX_TOKENS = SGLANG_DEFAULT_MAX_NEW_TOKENS

    max_new_tokens: integer(ge=1) | None = Field(None, description=f"left out: {SGLANG_DEFAULT_MAX_NEW_TOKENS} "
                                                 "(SGLang's default), lowered to what the context leaves")
    min_tokens: integer(ge=0) | None = Field(None, validation_alias="min_new_tokens",
                                             description="at most max_new_tokens")
    seed: integer() | None = Field(None, validation_alias="sampling_seed")
    json_schema: Text | None = Field(None, description="SGLang's: the output matches this JSON schema (as text)")

    @model_validator(mode="before")
    @classmethod
    def _sampling_fields_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            misplaced = [name for name in TOP_LEVEL_ONLY if name in data]
            if misplaced:
                raise ValueError(f"{misplaced[0]} is not a sampling parameter; give it at the request's top level")
        return data

    def constraints(self) -> list[tuple[str, Constraint]]:
        asked = super().constraints()
        if self.json_schema is not None:
            asked.append(("sampling_params.json_schema", json_schema_constraint(self.json_schema)))
        return asked


class GenerateBody(StrictRequest):
    # The prompt is exactly one of text and input_ids (neither may be null): said in the schema too.
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]})

    text: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] = None
    input_ids: Annotated[TokenIds | Annotated[list[TokenIds], Field(min_length=1)], PlainIdsFirst] = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    model: Text = Field(None, description="optional; when given, the served model's name",
                        json_schema_extra={SERVED_MODEL_MARK: True})
    # SGLang's logprob fields, at the values that ask for nothing (its clients send them): logprobs are not served.
    return_logprob: Annotated[bool, WithJsonSchema({"type": "boolean", "enum": [False]})] | None = Field(
        None, description="SGLang's; only false (no logprobs here)")
    top_logprobs_num: integer(ge=0, le=0) | None = Field(None, description="SGLang's; only 0")
    logprob_start_len: integer(ge=-1) | None = Field(None, description="SGLang's; without return_logprob it "
                                                                      "changes nothing")

    @model_validator(mode="before")
    @classmethod
    def _one_prompt_nothing_unserved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if ("text" in data) == ("input_ids" in data):
                raise ValueError("give exactly one of text or input_ids")
            unserved = [name for name in NOT_SERVED if data.get(name) not in (None, False)]
            if unserved:
                raise ValueError(f"{unserved[0]} is not supported by this server")
        return data

    def prompts(self) -> tuple[list[str] | list[list[int]], bool]:
        """The prompts as a batch, and whether the request gave a batch (it is then answered with a list)."""
        if self.text is not None:
            return ([self.text], False) if isinstance(self.text, str) else (self.text, True)
        ids = self.input_ids
        return ([ids], False) if isinstance(ids[0], int) else (ids, True)


# ---------------------------------------------------------------- response


class FinishReason(BaseModel):
    """SGLang's shape: `matched` is the stop string or stop/EOS token id that ended a "stop", `length`
    the completion length of a "length"."""

    type: Literal["stop", "length", "abort"]
    matched: str | int | None = Field(None, exclude_if=omitted)
    length: int | None = Field(None, exclude_if=omitted)


class MetaInfo(BaseModel):
    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float


class GenerateOutput(BaseModel):
    index: int
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class GenerateResponse(RootModel[GenerateOutput | list[GenerateOutput]]):
    pass
