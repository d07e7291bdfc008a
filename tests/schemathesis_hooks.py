"""Schemathesis hooks for the fuzz test (tests/e2e/test_hardening.py): positive_data_acceptance, made exact.

A schema-valid request must be accepted, except where a JSON schema cannot say in advance that it will be
refused: a prompt longer than the context (code context_length_exceeded), more sequences (prompts x n)
than may queue (code too_many_sequences), logit_bias (keys checked against the vocabulary, which a schema
cannot bound for map keys), grammars (a JSON schema, regex, EBNF or choice, under any of OpenAI's, SGLang's
or vLLM's names, that xgrammar cannot follow; two grammars at once), continue_final_message with
add_generation_prompt, tools (a chat template that cannot show them, tool_choice naming a function not in
tools or set without tools, no --tool-call-parser for auto), a Responses input without a message, a
previous_response_id that is not stored (code previous_response_not_found), background without store or with
stream, a stored response's cancel when it is not a background one (OpenAI's 400), its input_items `after` an
item it does not hold, and the rules across fields (min_tokens <= max_tokens, and none with a grammar; /generate's
min_new_tokens <= max_new_tokens; top_logprobs needs logprobs; prompt_logprobs_temperature needs prompt
scoring; stream_options needs stream; truncation_side needs truncate_prompt_tokens; a chat has messages or
vLLM's prompt_token_ids, not both, and the chat template's options only with messages), a thinking budget
(thinking_token_budget needs --reasoning-parser and no grammar), hidden states (return_hidden_states needs
--enable-return-hidden-states), and a seed just
past a signed 64-bit integer (schemathesis compares integers that large as floats, so 2**63 + 191 looks
equal to the bound 2**63 - 1). Each of those is a 400
that names its reason; any other 400 for schema-valid data fails the run.

The fuzzer's own bound: a chat or a Responses turn that leaves its length out runs until the context is full,
as OpenAI's and vLLM's do, and that takes a CPU longer than a fuzzed request may take. `before_call` sends every
generating body with its length at most MAX_GENERATED, and the server under test keeps the model's whole context.
In the stateful phase a created response is also stored and not streamed: its links lead to the stored response
by the id of the JSON answer, and a stream's events are no such answer. Nothing else of the case changes.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.generation.meta import TestPhase
from schemathesis.specs.openapi.checks import positive_data_acceptance

MAX_GENERATED = 16
# Where each generating route's body states its length (paths into the body).
LENGTHS = {"/v1/chat/completions": [("max_tokens",), ("max_completion_tokens",)], "/v1/completions": [("max_tokens",)],
           "/v1/responses": [("max_output_tokens",)], "/generate": [("sampling_params", "max_new_tokens")]}

REFUSALS_BY_CODE = {"context_length_exceeded", "too_many_sequences", "previous_response_not_found"}
REFUSALS_BY_PARAM = {"min_tokens", "sampling_params.min_new_tokens", "top_logprobs", "logit_bias",
                     "sampling_params.logit_bias", "stream_options",
                     "response_format", "regex", "ebnf", "tools", "tool_choice", "input", "structured_outputs",
                     "guided_json", "guided_regex", "guided_choice", "guided_grammar", "sampling_params.json_schema",
                     "continue_final_message", "prompt_logprobs_temperature", "seed", "truncation_side",
                     "messages", "prompt_token_ids", "add_generation_prompt", "echo", "chat_template_kwargs",
                     "background", "thinking_token_budget", "return_hidden_states", "after"}
CANCEL = "/v1/responses/{response_id}/cancel"  # refused (param response_id) for a response that is not background


@schemathesis.check
def schema_valid_data_accepted(ctx, response, case):
    try:
        return positive_data_acceptance(ctx, response, case)
    except AssertionError:
        error = response.json().get("error", {}) if response.status_code == 400 else {}
        if error.get("code") in REFUSALS_BY_CODE or error.get("param") in REFUSALS_BY_PARAM or \
                (case.operation.path == CANCEL and error.get("param") == "response_id"):
            return None
        raise


@schemathesis.hook
def before_call(ctx, case, kwargs):
    """Bound the length of a generation (see the module's docstring): a length over MAX_GENERATED is lowered to
    it; where none is given (left out or null) the first length field is set to it; a value of the wrong type
    stays as it is (it is what a negative case tests). A created response in the stateful phase is stored and whole."""
    paths = LENGTHS.get(case.operation.path) if case.method == "POST" else None
    if not paths or not isinstance(case.body, dict):
        return
    if case.operation.path == "/v1/responses" and case.meta is not None and case.meta.phase.name == TestPhase.STATEFUL:
        for name, value in (("stream", False), ("store", True)):  # its links lead to it stored (see above)
            if case.body.get(name) is (not value):
                case.body[name] = value
    given = False
    for *parents, name in paths:
        holder = dig(case.body, parents)
        length = holder.get(name) if isinstance(holder, dict) else None
        given |= length is not None
        if isinstance(length, (int, float)) and not isinstance(length, bool) and length > MAX_GENERATED:
            holder[name] = MAX_GENERATED
    *parents, name = paths[0]
    if not given and parents and parents[0] not in case.body:
        case.body[parents[0]] = {}
    holder = dig(case.body, parents)
    if not given and isinstance(holder, dict):
        holder[name] = MAX_GENERATED


def dig(body: dict, parents: list[str]) -> Any:
    for name in parents:
        body = body.get(name) if isinstance(body, dict) else None
    return body
