"""What is served: GET /v1/models, GET /v1/models/{id} (OpenAI's), and GET /version (vLLM's and SGLang's)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

import minisgl
from minisgl.server.errors import ApiError, error_responses
from minisgl.server.schemas.types import unix_now
from minisgl.server.state import ServerState, server_state

router = APIRouter()


class ModelCard(BaseModel):
    """OpenAI's model object, with vLLM's `root` (the checkpoint) and `max_model_len` (the context)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_now)
    owned_by: str = "minisgl"
    root: str
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Version(BaseModel):
    version: str


def served_card(state: ServerState) -> ModelCard:
    # root names what is served the way clients call it: a path of the machine it runs on would say nothing.
    name = state.args.served_model_name
    return ModelCard(id=name, root=name, max_model_len=state.client.info.get("max_seq_len"))


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401))
async def models(state: ServerState = Depends(server_state)):
    return ModelList(data=[served_card(state)])


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=error_responses(401, 404))
async def model(model: str, state: ServerState = Depends(server_state)):
    """One model by id; ids may hold slashes (`org/name`), as Hugging Face ids do."""
    if model != state.args.served_model_name:
        raise ApiError(404, f"the model {model[:200]!r} does not exist; this server serves "
                            f"'{state.args.served_model_name}'", param="model", code="model_not_found")
    return served_card(state)


@router.get("/version", response_model=Version, responses=error_responses(401))
async def version():
    return Version(version=minisgl.__version__)
