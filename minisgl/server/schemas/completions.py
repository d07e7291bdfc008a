"""The text completions API's wire schemas: the request, the answer and its streamed chunks."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from minisgl.server.schemas.logprobs import CompletionLogprobs, PromptLogprobs
from minisgl.server.schemas.sampling import HiddenStatesOption, SamplingFields, VllmExtras
from minisgl.server.schemas.types import (
    AnswerChoice,
    Choices,
    FirstPromptIds,
    LogprobCount,
    NewIds,
    NonEmptyText,
    PlainIdsFirst,
    PromptIds,
    TokenId,
    Usage,
    integer,
    new_id,
)

TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields, VllmExtras, HiddenStatesOption):
    prompt: Annotated[NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds |
                      Annotated[list[TokenIds], Field(min_length=1)], PlainIdsFirst]
    DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

    max_tokens: integer(ge=1) | None = Field(None, description="left out or null: 16 (OpenAI's default), lowered to "
                                             "what the context leaves; more than it leaves is a 400")
    logprobs: LogprobCount | None = None
    echo: bool = Field(False, description="the prompt before the output (with logprobs: the prompt's too)")
    add_special_tokens: bool = Field(True, description="vLLM's: a text prompt is encoded with the tokenizer's "
                                     "special tokens (a BOS), as vLLM and SGLang encode it; token ids are taken as "
                                     "they are")

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a batch: one string per prompt, or one token-id list per prompt."""
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else p


class CompletionChoice(AnswerChoice[CompletionLogprobs]):
    """A choice of the whole answer: `token_ids` and `prompt_token_ids` always there (null unless asked for), as
    vLLM answers (its clients test for the keys)."""

    text: str  # empty without a tokenizer (--skip-tokenizer-init): token_ids, given then too, stand for it
    prompt_token_ids: PromptIds = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's prompt_logprobs (when asked for)")


class CompletionResponse(Choices[CompletionChoice]):
    id: str = new_id("cmpl")
    object: Literal["text_completion"] = "text_completion"
    usage: Usage
    system_fingerprint: None = None  # OpenAI's, declared by its client: null, as vLLM answers


class CompletionChunkChoice(CompletionChoice):
    """A streamed choice: the ids only on the chunks that carry some."""

    token_ids: NewIds = None
    prompt_token_ids: FirstPromptIds = None


class CompletionChunk(Choices[CompletionChunkChoice]):
    id: str = new_id("cmpl")
    object: Literal["text_completion"] = "text_completion"
