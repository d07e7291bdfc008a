"""OpenAI's Responses API over HTTP: `POST /v1/responses` runs a turn (responses_turn.py) on the one pipeline;
the stored responses' routes are `GET`/`DELETE /v1/responses/{id}`, `POST .../cancel` and `GET .../input_items`.
Responses are stored (responses_store.py) unless `store: false`; `background: true` answers at once
(`queued`) and generates behind.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from starlette.requests import HTTPConnection

from minisgl.server.errors import ApiError, error_responses
from minisgl.server.pipeline import respond
from minisgl.server.responses_store import ResponseStore
from minisgl.server.responses_turn import ResponsesAnswer, responses_plan, responses_tool_use
from minisgl.server.schemas.responses import Deleted, InputItemList, ResponseObject, ResponsesRequest
from minisgl.server.state import ServerState, server_state

router = APIRouter()


# What a created response's id opens (openapi.json's links: a client, or a fuzzer, follows them): its stored routes,
# and the next turn of its conversation.
LINKS = {**{name: {"operationId": operation, "parameters": {"response_id": "$response.body#/id"}}
            for name, operation in (("get", "get_response_v1_responses__response_id__get"),
                                    ("delete", "delete_response_v1_responses__response_id__delete"),
                                    ("cancel", "cancel_response_v1_responses__response_id__cancel_post"),
                                    ("input_items", "input_items_v1_responses__response_id__input_items_get"))},
         "continue": {"operationId": "responses_v1_responses_post",
                      "requestBody": {"previous_response_id": "$response.body#/id"}}}
# A streamed turn's events: `event:` is the data's `type`; the lifecycle events (response.created, .in_progress,
# .completed, .incomplete, .failed) carry the response object as it stands.
EVENT = {"type": "object", "required": ["type", "sequence_number"], "properties": {
    "type": {"type": "string"}, "sequence_number": {"type": "integer", "minimum": 0},
    "response": {"$ref": "#/components/schemas/ResponseObject"}}}
RESPONSES = {200: {"model": ResponseObject, "content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["event", "data"], "description": "named events (event: response.created ... "
    "response.completed)", "properties": {"event": {"type": "string"}, "data": {
        "type": "string", "contentMediaType": "application/json", "contentSchema": EVENT}}}}},
    "links": LINKS}, **error_responses(400, 401, 404, 413, 500, 503)}


async def response_store(conn: HTTPConnection) -> ResponseStore:
    """FastAPI dependency: the app's store of responses (api.py makes it). Async for the reason server_state is:
    FastAPI runs a plain function on a worker thread."""
    return conn.app.state.responses


@router.post("/v1/responses", response_model=None, responses=RESPONSES)
async def responses(body: ResponsesRequest, request: Request, state: ServerState = Depends(server_state),
                    store: ResponseStore = Depends(response_store)) -> Response:
    history = store.previous(body.previous_response_id).messages if body.previous_response_id else []
    use = responses_tool_use(body, state.args.tool_call_parser)
    plan = responses_plan(body, history, use)
    answer = ResponsesAnswer(body, history, plan, use, state, store, store.put if body.stored else None)
    return await respond(request, state, plan, answer)


STORED = error_responses(400, 401, 404)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=STORED)
async def get_response(response_id: str, store: ResponseStore = Depends(response_store)) -> Response:
    """A stored response."""
    return Response(store.get(response_id).response.model_dump_json(), media_type="application/json")


@router.delete("/v1/responses/{response_id}", response_model=Deleted, responses=STORED)
async def delete_response(response_id: str, store: ResponseStore = Depends(response_store)) -> Response:
    """Forget a stored response (a background one still running is stopped first)."""
    await store.delete(response_id)
    return Response(Deleted(id=response_id).model_dump_json(), media_type="application/json")


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject, responses=STORED)
async def cancel_response(response_id: str, store: ResponseStore = Depends(response_store)) -> Response:
    """Stop a background response: its generation is aborted (its KV pages freed) before this answers."""
    entry = await store.cancel(response_id)
    return Response(entry.response.model_dump_json(), media_type="application/json")


@router.get("/v1/responses/{response_id}/input_items", response_model=InputItemList, responses=STORED)
async def input_items(response_id: str, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                      order: Literal["asc", "desc"] = "desc", after: str | None = None,
                      store: ResponseStore = Depends(response_store)) -> InputItemList:
    """The input items of a stored response (its own input, not the conversation before it), a page at a time."""
    items = store.get(response_id).input_items
    items = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, f"no input item {after[:200]!r} in response {response_id[:200]!r}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)
