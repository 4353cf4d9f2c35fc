"""GET /v1/models and GET /v1/models/{model_id}: every servable id (`name`, `name:version`,
`name@label`) with its context length."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from tokenserve.errors import ModelNotFoundError

from .models import ModelResolver
from .openapi import responses
from .schemas import ModelList, ModelObject


def models_router(models: ModelResolver) -> APIRouter:
    """The model list, read from `models` on every request (versions come and go)."""
    router = APIRouter()

    @router.get("/v1/models", responses=responses(ModelList, 401))
    async def list_models() -> JSONResponse:
        cards = [ModelObject(id=c.id, created=c.created, owned_by=c.owned_by, root=c.root,
                             max_model_len=c.max_model_len, parent=c.parent)
                 for c in models.list_models()]
        return JSONResponse(ModelList(data=cards).model_dump())

    @router.get("/v1/models/{model_id:path}", responses=responses(ModelObject, 401, 404))
    async def retrieve_model(model_id: str) -> JSONResponse:
        for card in models.list_models():
            if card.id == model_id:
                return JSONResponse(ModelObject(**card.__dict__).model_dump())
        raise ModelNotFoundError(f"The model '{model_id}' does not exist.")

    return router
