"""GET /load: how busy this server is, as vLLM's load-aware routers read it (vLLM serves it with
--enable-server-load-tracking; here it is always served)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from minisgl.server.errors import error_responses
from minisgl.server.state import ServerState, server_state

router = APIRouter()


class ServerLoad(BaseModel):
    server_load: int  # sequences admitted and not finished: being tokenized, queued or generating


@router.get("/load", response_model=ServerLoad, responses=error_responses(401))
async def load(state: ServerState = Depends(server_state)) -> ServerLoad:
    return ServerLoad(server_load=state.preparing + state.client.open_sequences)
