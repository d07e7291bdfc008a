"""POST /v1/completions: its request schema, its route, its response and its stream of chunks.

The prompt is text, token ids, or a batch of either. Without a tokenizer (--skip-tokenizer-init) only
token ids are accepted, `text` is empty and each choice carries `token_ids` instead. `echo` puts the
prompt before the output (and, with `logprobs`, its tokens' logprobs, the first one null).
"""

from __future__ import annotations

from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from minisgl.core import Constraint
from minisgl.server.boundary import GenerateRequest
from minisgl.server.generation import Choice, generation_responses, outputs, respond, usage, usage_so_far
from minisgl.server.protocol import (
    CompletionLogprobs,
    Envelope,
    HiddenStatesOption,
    LogprobCount,
    LogprobEntry,
    NonEmptyText,
    PromptLogprobs,
    SamplingFields,
    TokenId,
    Usage,
    VllmExtras,
    completion_logprobs,
    integer,
    new_id,
    omitted,
    vllm_prompt_logprobs,
)
from minisgl.server.state import ServerState, server_state
from minisgl.server.text import TextCodec

router = APIRouter()

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

    def sampling(self) -> tuple[dict[str, Any], dict[str, str]]:
        asked = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        prompt_logprobs = max(asked, default=None)
        return self.shared_sampling() | {"max_tokens": self.max_tokens, "logprobs": self.logprobs,
                                         "return_hidden_states": self.return_hidden_states} | \
            self.prompt_scoring(prompt_logprobs), {"prompt_logprobs": "logprobs"}

    def constraints(self) -> list[tuple[str, Constraint]]:
        return super().constraints() + self.vllm_constraints()

    def wants_prompt_text(self) -> bool:
        return self.echo


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=omitted,
                                        description="the output's token ids (return_token_ids, --skip-tokenizer-init)")
    prompt_token_ids: list[int] | None = Field(None, exclude_if=omitted,
                                               description="the prompt's token ids (return_token_ids)")
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


class CompletionChunk(Envelope):
    id: str = new_id("cmpl")
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


@router.post("/v1/completions", response_model=None,
             responses=generation_responses(CompletionResponse, CompletionChunk))
async def completions(body: CompletionRequest, request: Request,
                      state: ServerState = Depends(server_state)) -> Response:
    batch = body.prompts()
    model, ids_only = state.args.served_model_name, state.codec.tokenizer is None

    def whole(choices: list[Choice], usage: Usage) -> CompletionResponse:
        answers = []
        for c in choices:
            text, entries, ids = echoed(c, body, state.codec)
            answers.append(CompletionChoice(
                index=c.index, text=text + c.text, finish_reason=c.finish, matched_stop=c.matched_stop,
                hidden_states=c.hidden_states if body.return_hidden_states else None,
                **token_ids(c, body, ids_only, ids, True),
                logprobs=completion_logprobs(entries + c.logprobs, 0, body.return_tokens_as_token_ids)
                if body.logprobs is not None else None))
        return CompletionResponse(model=model, usage=usage, choices=answers)

    return await respond(request, state, body, batch, len(batch), whole,
                         lambda gen, choices: chunks(state, body, gen, choices, model, ids_only))


def token_ids(c: Choice, body: CompletionRequest, ids_only: bool, echoed_ids: list[int], first: bool,
              new_ids: list[int] | None = None) -> dict:
    """A choice's (or chunk's) token ids and prompt logprobs: the prompt's with the whole answer or a first
    chunk; the output's (all so far, or `new_ids`) with return_token_ids, or without a tokenizer. Asked for,
    they are the output's alone, as vLLM has them (echo or not: the prompt's are in prompt_token_ids); without
    a tokenizer and not asked for, they stand for the text, an echoed prompt's ids first."""
    output = c.token_ids if new_ids is None else new_ids
    fields: dict = {"token_ids": output if body.return_token_ids else echoed_ids + output if ids_only else None}
    if first and body.return_token_ids:
        fields["prompt_token_ids"] = c.prompt_ids
    if first and body.prompt_logprobs is not None:
        n = body.prompt_logprobs  # echo's logprobs may have asked the engine for more
        fields["prompt_logprobs"] = vllm_prompt_logprobs([e._replace(top=e.top[:n]) for e in c.prompt_logprobs or []])
    return fields


def echoed(c: Choice, body: CompletionRequest, codec: TextCodec) -> tuple[str, list[LogprobEntry], list[int]]:
    """What `echo` puts before a choice's output: the prompt's text, its logprob entries (when asked for,
    the first token's logprob null), its token ids."""
    if not body.echo:
        return "", [], []
    first = LogprobEntry(codec.token_text(c.prompt_ids[0]), c.prompt_ids[0], None, [])
    scored = [e._replace(top=e.top[:body.logprobs]) for e in c.prompt_logprobs or []]  # prompt_logprobs may ask more
    entries = [first, *scored] if c.prompt_logprobs and body.logprobs is not None else []
    return c.prompt_text or "", entries, c.prompt_ids


async def chunks(state: ServerState, body: CompletionRequest, gen: GenerateRequest, choices: list[Choice],
                 model: str, ids_only: bool) -> AsyncIterator[CompletionChunk]:
    chunk_id = CompletionChunk(model=model, choices=[]).id
    started: set[int] = set()  # choices whose first chunk (which carries the echo) went out
    async for choice, out in outputs(state, choices):
        first = choice.index not in started
        text, entries, ids = echoed(choice, body, state.codec) if first else ("", [], [])
        started.add(choice.index)
        ids_asked = ids_only or body.return_token_ids
        if text or out.text or out.finish_reason or out.logprobs or entries or (ids_asked and out.new_ids) or (
                first and body.prompt_logprobs is not None):
            offset = (len(choice.prompt_text or "") if body.echo else 0) + len(choice.text) - len(out.text) - len(text)
            yield CompletionChunk(id=chunk_id, model=model, choices=[CompletionChoice(
                index=choice.index, text=text + out.text, finish_reason=out.finish_reason,
                logprobs=completion_logprobs(entries + out.logprobs, offset, body.return_tokens_as_token_ids)
                if entries or out.logprobs else None,
                **token_ids(choice, body, ids_only, ids, first, out.new_ids))],
                usage=usage_so_far(choice) if body.continuous_usage else None)
        if out.finish_reason and body.return_hidden_states:
            yield CompletionChunk(id=chunk_id, model=model, choices=[CompletionChoice(
                index=choice.index, text="", hidden_states=choice.hidden_states)])
    if body.include_usage:
        yield CompletionChunk(id=chunk_id, model=model, choices=[], usage=usage(choices, gen.prompts))
