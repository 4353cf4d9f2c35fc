"""The Responses API's routes: POST /v1/responses (SSE with `stream: true`), GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items (responses.py and its
responses_* siblings hold the rest)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from .config import OpenAIServerConfig
from .embeddings import require_generator
from .http import EventStream, read_json, unless_disconnected, with_error_event
from .models import ModelResolver
from .openapi import GENERATION_ERRORS, request_body, responses
from .responses import ResponseRun
from .responses_stored import input_items_page, key_owner, owned_response
from .responses_schemas import (DeletedResponse, InputItemList, ResponseCreateRequest,
                                ResponseObject)
from .streams import trace_context


def responses_router(models: ModelResolver, config: OpenAIServerConfig, store) -> APIRouter:
    """The Responses API over `models`, keeping stored responses in `store`
    (tokenserve.state.response_store)."""
    router = APIRouter()

    @router.post("/v1/responses", openapi_extra=request_body(ResponseCreateRequest),
                 responses=responses(ResponseObject, *GENERATION_ERRORS, stream=True))
    async def create(request: Request) -> Response:
        body = await read_json(request, ResponseCreateRequest, config.max_body_bytes,
                               config.max_json_depth)
        previous = None if body.previous_response_id is None else await owned_response(
            store, request, config, body.previous_response_id, "previous_response_id")
        model_id = body.model or models.default_model()
        request.state.model = model_id
        held = models.acquire(model_id)
        engine = held.__enter__()
        try:
            require_generator(engine, model_id)
            run = await run_in_threadpool(ResponseRun, body, engine, model_id, config, previous,
                                          key_owner(request, config),
                                          trace_context(request.headers))
            await unless_disconnected(request, run.outputs.start())
        except BaseException as error:
            held.__exit__(type(error), error, error.__traceback__)
            raise

        async def save(final: ResponseObject) -> None:
            if body.store:
                await run_in_threadpool(store.put, run.stored(final))

        async def close() -> None:
            try:
                await run.outputs.aclose()
            finally:
                held.__exit__(None, None, None)

        if body.stream:
            return EventStream(with_error_event(run.events(save)), on_close=close)
        try:
            final = await unless_disconnected(request, run.response())
            await save(final)
        finally:
            await close()
        return JSONResponse(final.model_dump())

    @router.get("/v1/responses/{response_id}",
                responses=responses(ResponseObject, 400, 401, 404))
    async def retrieve(request: Request, response_id: str) -> JSONResponse:
        return JSONResponse((await owned_response(store, request, config, response_id)).response)

    @router.delete("/v1/responses/{response_id}",
                   responses=responses(DeletedResponse, 400, 401, 404))
    async def delete(request: Request, response_id: str) -> JSONResponse:
        await owned_response(store, request, config, response_id)
        await run_in_threadpool(store.delete, response_id)
        return JSONResponse(DeletedResponse(id=response_id).model_dump())

    @router.get("/v1/responses/{response_id}/input_items",
                responses=responses(InputItemList, 400, 401, 404))
    async def input_items(request: Request, response_id: str, order: str = "desc",
                          limit: int = 20, after: str | None = None) -> JSONResponse:
        stored = await owned_response(store, request, config, response_id)
        return JSONResponse(input_items_page(stored.input_items, order, limit,
                                             after).model_dump())

    return router
