"""The /tokenize and /detokenize wire schemas."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from minisgl.server.schemas.chat import ChatMessage, TemplateOptions, Tool
from minisgl.server.schemas.types import SERVED_MODEL_MARK, StrictRequest, Text, TokenId


class ModelOption(StrictRequest):
    """vLLM's optional `model` of /tokenize and /detokenize."""

    model: Text = Field(None, json_schema_extra={SERVED_MODEL_MARK: True},
                        description="optional (null refused); when given, the served model (else 404)")


class TokenizeOptions(ModelOption):
    """vLLM's options of both shapes."""

    return_token_strs: bool = Field(False, description="also each token as the tokenizer spells it")


class TokenizeText(TokenizeOptions):
    prompt: Text
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (a BOS), as "
                                     "/v1/completions does by default (vLLM's and SGLang's default)")


class TokenizeChat(TemplateOptions, TokenizeOptions):
    """A conversation: its token ids after the chat template, as /v1/chat/completions would see them."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, description="shown to the model by the chat template, as on chat")
    add_special_tokens: bool = Field(False, description="add the tokenizer's special tokens (a BOS) to what the "
                                     "chat template wrote, as chat's field of the same name (vLLM's default)")

    @model_validator(mode="before")
    @classmethod
    def _not_also_a_prompt(cls, data: Any) -> Any:
        """The schema is one of the two shapes: a body with both would be silently half-ignored."""
        if isinstance(data, dict) and "prompt" in data:
            raise ValueError("give either prompt or messages, not both")
        return data


def _which(body: object) -> str:
    return "TokenizeChat" if isinstance(body, dict) and "messages" in body else "TokenizeText"


# A body with `messages` is a conversation, any other a text: errors then speak of the fields it sent.
TokenizeRequest = Annotated[Annotated[TokenizeText, Tag("TokenizeText")] | Annotated[TokenizeChat, Tag("TokenizeChat")],
                            Discriminator(_which)]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = Field(None, description="with return_token_strs (else null, as vLLM has it)")


class DetokenizeRequest(ModelOption):
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
