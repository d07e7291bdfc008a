"""The text completions API's wire schemas: the request, the answer and its streamed chunks."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from minisgl.server.schemas.logprobs import CompletionLogprobs, PromptLogprobs
from minisgl.server.schemas.sampling import HiddenStatesOption, SamplingFields, VllmExtras
from minisgl.server.schemas.types import Envelope, LogprobCount, NonEmptyText, TokenId, Usage, integer, new_id, omitted

TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields, VllmExtras, HiddenStatesOption):
    prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)]
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


class CompletionChoice(BaseModel):
    """A choice of the whole answer: `token_ids` and `prompt_token_ids` always there (null unless asked for), as
    vLLM answers (its clients test for the keys)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, description="the output's token ids (return_token_ids, "
                                                          "--skip-tokenizer-init)")
    prompt_token_ids: list[int] | None = Field(None, description="the prompt's token ids (return_token_ids)")
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's prompt_logprobs (when asked for)")
    matched_stop: str | int | None = Field(None, description="SGLang's: the stop string or stop/EOS token id that "
                                                             "ended a 'stop' choice")
    hidden_states: list[float] | None = Field(None, exclude_if=omitted, description="SGLang's return_hidden_states "
                                              "(streamed: in a chunk of its own after the choice's last)")


class CompletionResponse(Envelope):
    id: str = new_id("cmpl")
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: None = None  # OpenAI's, declared by its client: null, as vLLM answers


class CompletionChunkChoice(CompletionChoice):
    """A streamed choice: the ids only on the chunks that carry some."""

    token_ids: list[int] | None = Field(None, exclude_if=omitted, description="the new ids (return_token_ids, "
                                                                             "--skip-tokenizer-init)")
    prompt_token_ids: list[int] | None = Field(None, exclude_if=omitted, description="with a choice's first chunk")


class CompletionChunk(Envelope):
    id: str = new_id("cmpl")
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
