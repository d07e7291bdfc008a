"""POST /generate: SGLang's native API, as `sglang.bench_serving --backend sglang`, SGLang's router and
scripts written for SGLang speak it.

    {"text": "...", "sampling_params": {"max_new_tokens": 16, "temperature": 0}, "stream": false}
    -> {"text": "...", "output_ids": [...], "meta_info": {"finish_reason": {"type": "stop", "matched": "\\n"}, ...}}

The prompt is `text` (a string or a batch of them) or `input_ids` (ids, or a batch). One prompt with
n = 1 is answered with one object, anything else with a list (prompt-major, then sample). Streamed
events carry, like SGLang's, the whole text and ids so far, not a delta; `meta_info.finish_reason` is
null until the last event of a sequence. The request goes through the same boundary and engine as
the OpenAI routes; only the names differ (`max_new_tokens`, `min_new_tokens`, `sampling_seed`).
"""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from minisgl.server.boundary import CheckedRequest
from minisgl.server.pipeline import Answer, Choice, generation_responses, outputs, respond
from minisgl.server.plan import Plan, sampling_plan
from minisgl.server.schemas.generate import (
    SGLANG_NAMES,
    FinishReason,
    GenerateBody,
    GenerateOutput,
    GenerateResponse,
    MetaInfo,
)
from minisgl.server.schemas.types import Usage
from minisgl.server.state import ServerState, server_state

router = APIRouter()


def output(request_id: str, choice: Choice) -> GenerateOutput:
    """A sequence as SGLang reports it: everything it produced so far."""
    finish = None
    if choice.finish is not None:
        finish = FinishReason(type=choice.finish, matched=choice.matched_stop,
                              length=len(choice.token_ids) if choice.finish == "length" else None)
    seq = choice.seq
    return GenerateOutput(index=choice.index, text=choice.text, output_ids=choice.token_ids, meta_info=MetaInfo(
        id=f"{request_id}-{choice.index}", finish_reason=finish, prompt_tokens=seq.prompt_tokens,
        completion_tokens=seq.completion_tokens, cached_tokens=seq.cached_tokens,
        e2e_latency=time.monotonic() - seq.start))


def generate_plan(body: GenerateBody) -> Plan:
    """A /generate body as the pipeline's plan: its sampling_params with the top-level model and stream; errors
    name the fields as SGLang spells them (sampling_params.max_new_tokens...)."""
    params = body.sampling_params
    plan = sampling_plan(params, body.prompts()[0], {"max_tokens": params.max_new_tokens, "logprobs": None},
                         constraints=params.constraints(), special_tokens=True)
    plan.model, plan.output.stream = body.model, body.stream
    plan.renamed = {name: f"sampling_params.{SGLANG_NAMES.get(name, name)}" for name in plan.sampling}
    return plan


@router.post("/generate", response_model=None, responses=generation_responses(GenerateResponse, GenerateOutput))
async def generate(body: GenerateBody, request: Request, state: ServerState = Depends(server_state)) -> Response:
    return await respond(request, state, generate_plan(body), GenerateAnswer(body, state))


class GenerateAnswer(Answer):
    """SGLang's answer: one object for one prompt with n = 1, else a list (prompt-major, then sample); streamed
    events carry each sequence's whole text and ids so far, not a delta."""

    def __init__(self, body: GenerateBody, state: ServerState):
        self.body, self.state, self.request_id = body, state, uuid.uuid4().hex

    def whole(self, choices: list[Choice], usage: Usage) -> GenerateResponse:
        answers = [output(self.request_id, c) for c in choices]
        batched = self.body.prompts()[1]
        return GenerateResponse(answers if batched or self.body.sampling_params.n > 1 else answers[0])

    async def stream(self, checked: CheckedRequest, choices: list[Choice]) -> AsyncIterator[GenerateOutput]:
        async for choice, out in outputs(self.state, choices):
            if out.text or out.new_ids or out.finish_reason:
                yield output(self.request_id, choice)
