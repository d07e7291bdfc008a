"""What operators and probes call: health, a deep health check, metrics and server info."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from minisgl.core import SamplingParams
from minisgl.server.engine_client import RequestFailed
from minisgl.server.errors import ApiError, error_responses
from minisgl.server.state import ServerState, server_state

logger = logging.getLogger("minisgl.api")
router = APIRouter()

HEALTH_GENERATE_TIMEOUT = 30.0
STATS_TIMEOUT = 5.0


class Health(BaseModel):
    status: str


def unhealthy(status: str) -> JSONResponse:
    return JSONResponse(Health(status=status).model_dump(), 503, headers={"Retry-After": "5"})


UNHEALTHY = {503: {"model": Health, "description": "Loading, draining, or (deep check) the generation failed"}}


@router.get("/health", response_model=Health, responses=UNHEALTHY)
async def health(state: ServerState = Depends(server_state)):
    """200 once the model is loaded and warmed up; never waits on the engine (a liveness probe)."""
    if state.draining or not state.client.ready.is_set():
        return unhealthy("draining" if state.draining else "loading")
    return Health(status="ok")


@router.get("/health_generate", response_model=Health, responses={**UNHEALTHY, **error_responses(401)})
async def health_generate(state: ServerState = Depends(server_state)):
    """A one-token generation through the whole stack (a deep check, not for frequent probes)."""
    if state.draining or not state.client.ready.is_set():
        return unhealthy("draining" if state.draining else "loading")
    client = state.client
    client.admit(1, None)  # counted like any request, never refused for a full queue
    seq = client.submit([0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), [], 0)

    async def finish() -> None:
        async for _ in client.stream(seq):
            pass

    try:
        await asyncio.wait_for(finish(), HEALTH_GENERATE_TIMEOUT)
    except asyncio.TimeoutError:
        return unhealthy("the generation timed out")
    except RequestFailed as failed:
        return unhealthy(f"the generation failed: {failed.message}")
    return Health(status="ok")


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def metrics(state: ServerState = Depends(server_state)):
    """Prometheus text format, SGLang's metric names (or vLLM's: --metrics-naming vllm)."""
    if state.client.ready.is_set():
        try:
            state.metrics.update_scheduler(await state.client.stats(timeout=2))
        except asyncio.TimeoutError:
            logger.warning("scheduler stats timed out; serving the last known values")
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)


@router.get("/get_server_info", responses=error_responses(401, 503))
async def server_info(state: ServerState = Depends(server_state)) -> dict:
    """The settings, the model's limits, the scheduler's live stats and the child processes."""
    stats = {}
    if state.client.ready.is_set():
        try:
            stats = await state.client.stats(timeout=STATS_TIMEOUT)
        except asyncio.TimeoutError:
            raise ApiError(503, "the scheduler did not answer in time", retry_after=1) from None
    return {**vars(state.args.engine), "served_model_name": state.args.served_model_name, **state.client.info,
            "scheduler": stats, "preparing": state.preparing, "draining": state.draining, "children": state.children}
