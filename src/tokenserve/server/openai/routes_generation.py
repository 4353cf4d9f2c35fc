"""POST /v1/completions and POST /v1/chat/completions: one JSON body, or SSE with `stream`."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from .chat import ChatRun
from .completions import CompletionRun
from .config import OpenAIServerConfig
from .embeddings import require_generator
from .http import EventStream, read_json, unless_disconnected, with_error_event
from .models import ModelResolver
from .openapi import GENERATION_ERRORS, request_body, responses
from .schemas import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                      CompletionResponse)
from .streams import trace_context


def generation_router(models: ModelResolver, config: OpenAIServerConfig) -> APIRouter:
    """The two generation routes; each request holds its model version until it ends."""
    router = APIRouter()

    async def generate(request: Request, body: CompletionRequest | ChatCompletionRequest,
                       make_run: Callable[..., CompletionRun | ChatRun]) -> Response:
        model_id = body.model or models.default_model()
        request.state.model = model_id
        with ExitStack() as held:
            engine = held.enter_context(models.acquire(model_id))  # a reload waits for it
            require_generator(engine, model_id)
            # Off the event loop: rendering and tokenizing a long prompt takes a while, and
            # every other request and stream on this port waits for the loop.
            run = await run_in_threadpool(make_run, body, engine, model_id, config,
                                          trace_context(request.headers))
            headers = {"X-Request-Id": run.request_id}
            try:
                await unless_disconnected(request, run.outputs.start())
            except BaseException:
                await run.outputs.aclose()
                raise
            if body.stream:
                return _event_stream(run, held.pop_all(), headers)  # outlives this handler
            try:
                result = await unless_disconnected(request, run.response())
            finally:
                await run.outputs.aclose()
            return JSONResponse(result.model_dump(), headers=headers)

    @router.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
                 responses=responses(CompletionResponse, *GENERATION_ERRORS, stream=True))
    async def completions(request: Request) -> Response:
        body = await read_json(request, CompletionRequest, config.max_body_bytes,
                               config.max_json_depth)
        return await generate(request, body, CompletionRun)

    @router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
                 responses=responses(ChatCompletionResponse, *GENERATION_ERRORS, stream=True))
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, ChatCompletionRequest, config.max_body_bytes,
                               config.max_json_depth)
        return await generate(request, body, ChatRun)

    return router


def _event_stream(run: CompletionRun | ChatRun, release: ExitStack,
                  headers: dict[str, str]) -> EventStream:
    """The run's SSE events; closing the stream aborts the run, then releases its version."""
    async def close() -> None:
        try:
            await run.outputs.aclose()
        finally:
            release.close()

    response = EventStream(with_error_event(run.events()), on_close=close)
    response.headers.update(headers)
    return response
