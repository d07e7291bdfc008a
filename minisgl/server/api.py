"""The FastAPI app: the routes of every front, the checks every request passes first, the error handlers,
and an openapi.json that says what the server really answers.

Where things are (docs/architecture.md follows one request through them): schemas/ the wire models, one file
per API; routes/ adapt each API (its request as a plan, its answer's shape); plan.py what a route hands the
pipeline; boundary.py the one place requests are checked; pipeline.py runs every API's plan; sse.py frames
streams; errors.py is the error shape and builder; parsers/ split tool calls and reasoning from the output
text; middleware.py the API key and the body size limit.
"""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import Route
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from minisgl.server.errors import DESCRIPTIONS, install_error_handlers
from minisgl.server.middleware import OPEN_PATHS, ApiKeyCheck, BodySizeLimit, RequestIdHeader
from minisgl.server.responses_store import ResponseStore
from minisgl.server.routes import chat, completions, generate, load, models, ops, responses, responses_ws, tokenize
from minisgl.server.routes.invocations import invocations_router
from minisgl.server.schemas.chat import ChatCompletionChunk, ChatCompletionRequest
from minisgl.server.schemas.completions import CompletionChunk, CompletionRequest
from minisgl.server.schemas.generate import GenerateOutput
from minisgl.server.schemas.types import (
    HIDDEN_STATES_MARK,
    LOGPROBS_MARK,
    SERVED_MODEL_MARK,
    THINKING_MARK,
    TOKEN_ID_MARK,
)
from minisgl.server.state import ServerState

logger = logging.getLogger("minisgl.api")


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(state.client.run()), asyncio.create_task(announce_ready(state))]  # kept: not GC'd
        yield
        for task in tasks:
            task.cancel()

    # root_path: paths under it are routed without it; paths outside it are routed as they are (vLLM's behaviour).
    app = FastAPI(title="minisgl", summary="OpenAI-compatible LLM server", lifespan=lifespan,
                  root_path=state.args.root_path)
    app.state.server = state
    app.state.responses = ResponseStore(state.args.max_stored_responses)
    install_error_handlers(app)
    routers = [module.router for module in (chat, completions, responses, responses_ws, generate, tokenize, models,
                                            load, ops)]
    routers.append(invocations_router({"messages": (ChatCompletionRequest, chat.chat_completions),
                                       "prompt": (CompletionRequest, completions.completions)}))
    for router in routers:
        app.include_router(router)
    # every HTTP route, FastAPI's own (docs) and ours (not as included: FastAPI wraps those), for a 405's Allow
    app.state.routes = [route for route in (*app.router.routes, *(r for router in routers for r in router.routes))
                        if isinstance(route, Route)]
    app.add_middleware(BodySizeLimit, limit=state.args.max_request_bytes)
    if state.args.api_key:
        app.add_middleware(ApiKeyCheck, key=state.args.api_key)
    if state.args.request_id_headers:
        app.add_middleware(RequestIdHeader)  # added last: runs first (a 401 or a 413 carries the id too)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            app.openapi_schema = describe_this_server(schema, state, [ChatCompletionChunk, CompletionChunk,
                                                                      GenerateOutput])
        return app.openapi_schema

    app.openapi = openapi
    return app


def describe_this_server(schema: dict, state: ServerState, event_models: list[type[BaseModel]]) -> dict:
    """Fit FastAPI's generated schema to what this server answers: errors are 400 (never FastAPI's 422), any
    route may answer 500 and any POST 413, `model` is the served model, token ids are bounded by its vocabulary,
    logprob counts by --max-logprobs, the options this server was not started for (a thinking budget, hidden
    states) are held to their off values, streamed chunks are described, and with --api-key every route but the
    probes' declares the bearer key."""
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            operation["responses"].pop("422", None)
            # errors.py answers these on every route: a fault in any handler (500), any body over the limit (413)
            for status in (500, 413) if method == "post" else (500,):
                operation["responses"].setdefault(str(status), {"description": DESCRIPTIONS[status], "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
            if state.args.api_key and path not in OPEN_PATHS:
                operation["security"] = [{"bearer": []}]
    components = schema.setdefault("components", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(unused, None)
    _, events = models_json_schema([(model, "serialization") for model in event_models],
                                   ref_template="#/components/schemas/{model}")
    components.setdefault("schemas", {}).update(events["$defs"])
    if state.args.api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}

    fill_in = {TOKEN_ID_MARK: {"maximum": state.vocab_size - 1},
               SERVED_MODEL_MARK: {"enum": [state.args.served_model_name]},
               LOGPROBS_MARK: {"maximum": state.args.logprobs_cap(state.vocab_size)},
               THINKING_MARK: {} if state.thinking_markers else {"maximum": -1},  # budgets need the parser's markers
               HIDDEN_STATES_MARK: {} if state.args.return_hidden_states else {"enum": [False]}}

    def fill(node: Any) -> None:
        if isinstance(node, dict):
            for mark in [key for key in node if key in fill_in]:
                del node[mark]
                node.update(fill_in[mark])
            for value in node.values():
                fill(value)
        elif isinstance(node, list):
            for value in node:
                fill(value)

    fill(schema)
    return schema


def seconds_since_start() -> float:
    """Since this process started (Linux /proc): the time to ready that autoscaling waits for, imports and
    all. -1 where /proc is not there."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            return float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return -1.0


def http_stack() -> str:
    """The HTTP parser and event loop this process serves with, as uvicorn chose them: without httptools it
    parses with the pure-Python h11, which costs more CPU per request and per streamed chunk (what a burst's
    admissions and a busy server's streams wait on), so benchmark logs should say which ran."""
    parser = AutoHTTPProtocol.__module__.rsplit(".", 1)[-1].removesuffix("_impl")  # uvicorn's "auto" pick
    return f"{parser}, {type(asyncio.get_running_loop()).__module__.split('.')[0]} loop"


async def announce_ready(state: ServerState) -> None:
    await state.client.ready.wait()
    info = state.client.info
    where = state.args.uds or f"{state.args.host}:{state.args.port}"
    logger.info("ready in %.1f s: model=%s dtype=%s device=%s tp=%d kv_capacity=%d tokens max_seq_len=%d on %s "
                "(HTTP by %s)", seconds_since_start(), state.args.served_model_name, info["dtype"], info["device"],
                info["tp_size"], info["kv_capacity_tokens"], info["max_seq_len"], where, http_stack())
