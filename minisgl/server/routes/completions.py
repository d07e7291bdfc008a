"""POST /v1/completions: the request as a plan, and its run given back as the answer or its stream of chunks.

The prompt is text, token ids, or a batch of either. Without a tokenizer (--skip-tokenizer-init) only
token ids are accepted, `text` is empty and each choice carries `token_ids` instead. `echo` puts the
prompt before the output (and, with `logprobs`, its tokens' logprobs, the first one null).
"""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from minisgl.messages import LogprobEntry
from minisgl.server.boundary import CheckedRequest
from minisgl.server.detokenizer import token_text
from minisgl.server.pipeline import Answer, Choice, Chunks, generation_responses, outputs, respond
from minisgl.server.plan import Plan, vllm_plan
from minisgl.server.schemas.completions import (
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
    CompletionResponse,
)
from minisgl.server.schemas.logprobs import CompletionLogprobs, completion_logprobs, vllm_prompt_logprobs
from minisgl.server.schemas.types import Usage
from minisgl.server.state import ServerState, server_state
from minisgl.server.text import TextCodec

router = APIRouter()


def completion_plan(body: CompletionRequest) -> Plan:
    """A text completion as the pipeline's plan; echo's logprobs score the prompt too (the larger count of
    echo's and prompt_logprobs' is asked of the engine)."""
    asked = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None]
    counts = {name: count for name, count in (("logprobs", body.logprobs), ("prompt_logprobs", body.prompt_logprobs))
              if count is not None}
    return vllm_plan(body, body.prompts(), {"max_tokens": body.max_tokens, "logprobs": body.logprobs},
                     max(asked, default=None), body.return_hidden_states, renamed={"prompt_logprobs": "logprobs"},
                     constraints=body.constraints() + body.vllm_constraints(), logprob_counts=counts,
                     special_tokens=body.add_special_tokens, prompt_text=body.echo)


@router.post("/v1/completions", response_model=None,
             responses=generation_responses(CompletionResponse, CompletionChunk))
async def completions(body: CompletionRequest, request: Request,
                      state: ServerState = Depends(server_state)) -> Response:
    plan = completion_plan(body)
    return await respond(request, state, plan, CompletionAnswer(body, plan, state))


class CompletionAnswer(Answer):
    """A text completion's run given back: each choice's text after what `echo` puts first, whole or as chunks.
    Without a tokenizer (--skip-tokenizer-init) each choice carries its token ids instead."""

    def __init__(self, body: CompletionRequest, plan: Plan, state: ServerState):
        self.body, self.output, self.state = body, plan.output, state
        self.model, self.ids_only = state.args.served_model_name, state.codec.tokenizer is None

    def logprobs(self, entries: list[LogprobEntry], offset: int) -> CompletionLogprobs:
        return completion_logprobs(entries, offset, self.output.tokens_as_ids)

    def whole(self, choices: list[Choice], usage: Usage) -> CompletionResponse:
        body, answers = self.body, []
        for c in choices:
            text, entries, ids = echoed(c, body, self.state.codec)
            answers.append(CompletionChoice(
                index=c.index, text=text + c.text, finish_reason=c.finish, matched_stop=c.matched_stop,
                hidden_states=c.hidden_states if self.output.hidden_states else None,
                **token_ids(c, body, self.ids_only, ids, True),
                prompt_logprobs=vllm_prompt_logprobs(c.prompt_logprobs, body.prompt_logprobs),
                logprobs=self.logprobs(entries + c.logprobs, 0) if body.logprobs is not None else None))
        return CompletionResponse(model=self.model, usage=usage, choices=answers)

    async def stream(self, checked: CheckedRequest, choices: list[Choice]) -> AsyncIterator[CompletionChunk]:
        body, chunks = self.body, Chunks(CompletionChunk, self.model, self.output, self.body.prompt_logprobs)
        started: set[int] = set()  # choices whose first chunk (which carries the echo) went out
        async for choice, out in outputs(self.state, choices):
            first = choice.index not in started
            text, entries, ids = echoed(choice, body, self.state.codec) if first else ("", [], [])
            started.add(choice.index)
            ids_asked = self.ids_only or body.return_token_ids
            prompt_logprobs = chunks.prompt_logprobs(choice)
            if text or out.text or out.finish_reason or out.logprobs or entries or (ids_asked and out.new_ids) or \
                    prompt_logprobs is not None:
                offset = (len(choice.prompt_text or "") if body.echo else 0) + len(choice.text) - len(out.text) \
                    - len(text)
                yield chunks.chunk([CompletionChunkChoice(
                    index=choice.index, text=text + out.text, finish_reason=out.finish_reason,
                    logprobs=self.logprobs(entries + out.logprobs, offset) if entries or out.logprobs else None,
                    **token_ids(choice, body, self.ids_only, ids, first, out.new_ids),
                    prompt_logprobs=prompt_logprobs)], choice)
            for chunk in chunks.hidden_states(choice, out, lambda index, hidden: CompletionChunkChoice(
                    index=index, text="", hidden_states=hidden)):
                yield chunk
        for chunk in chunks.last(checked, choices):
            yield chunk


def token_ids(c: Choice, body: CompletionRequest, ids_only: bool, echoed_ids: list[int], first: bool,
              new_ids: list[int] | None = None) -> dict:
    """A choice's (or chunk's) token ids: the prompt's with the whole answer or a first chunk; the output's (all
    so far, or `new_ids`) with return_token_ids, or without a tokenizer. Asked for, they are the output's alone,
    as vLLM has them (echo or not: the prompt's are in prompt_token_ids); without a tokenizer and not asked for,
    they stand for the text, an echoed prompt's ids first."""
    output = c.token_ids if new_ids is None else new_ids
    fields: dict = {"token_ids": output if body.return_token_ids else echoed_ids + output if ids_only else None}
    if first and body.return_token_ids:
        fields["prompt_token_ids"] = c.prompt_ids
    return fields


def echoed(c: Choice, body: CompletionRequest, codec: TextCodec) -> tuple[str, list[LogprobEntry], list[int]]:
    """What `echo` puts before a choice's output: the prompt's text, its logprob entries (when asked for,
    the first token's logprob null), its token ids."""
    if not body.echo:
        return "", [], []
    first = LogprobEntry(token_text(codec.tokenizer, c.prompt_ids[0]), c.prompt_ids[0], None, [])  # one: cheap
    scored = [e._replace(top=e.top[:body.logprobs]) for e in c.prompt_logprobs or []]  # prompt_logprobs may ask more
    entries = [first, *scored] if c.prompt_logprobs and body.logprobs is not None else []
    return c.prompt_text or "", entries, c.prompt_ids
