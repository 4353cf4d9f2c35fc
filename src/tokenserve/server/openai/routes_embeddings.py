"""POST /v1/embeddings and POST /v1/rerank (also /rerank and /v2/rerank, as vLLM serves it):
encoder models, their inputs batched with every other client's (engine/encoder_batcher.py)."""

from __future__ import annotations

from contextlib import ExitStack

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from tokenserve.encoder_config import EncoderTask
from tokenserve.errors import TokenserveError

from .config import OpenAIServerConfig
from .embedding_schemas import (EmbeddingRequest, EmbeddingResponse, RerankRequest,
                                RerankResponse)
from .embeddings import (check_dimensions, document_texts, embedding_inputs,
                         embedding_response, relevance, require_task, rerank_inputs,
                         rerank_response)
from .http import read_json, unless_disconnected
from .models import ModelResolver
from .openapi import GENERATION_ERRORS, request_body, responses
from .params import request_timeout
from .streams import trace_context

RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")


def embeddings_router(models: ModelResolver, config: OpenAIServerConfig) -> APIRouter:
    """The encoder routes; each request holds its model version until it is answered."""
    router = APIRouter()

    def model_for(request: Request, requested: str | None, task: EncoderTask) -> str:
        """The requested model id, or the first served model of `task`."""
        model_id = requested or _first_model_of(models, task)
        request.state.model = model_id
        return model_id

    async def encode(request: Request, engine, inputs: list, timeout: float | None):
        return await unless_disconnected(request, engine.encode(
            inputs, timeout_s=request_timeout(timeout, config.request_timeout_s),
            trace_context=trace_context(request.headers)))

    @router.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest),
                 responses=responses(EmbeddingResponse, *GENERATION_ERRORS))
    async def embeddings(request: Request) -> JSONResponse:
        body = await read_json(request, EmbeddingRequest, config.max_body_bytes,
                               config.max_json_depth)
        model_id = model_for(request, body.model, EncoderTask.EMBED)
        with ExitStack() as held:
            engine = held.enter_context(models.acquire(model_id))  # a reload waits for it
            require_task(engine, model_id, EncoderTask.EMBED, "/v1/embeddings")
            check_dimensions(body.dimensions, engine.config.output_size)
            inputs = await run_in_threadpool(embedding_inputs, body, engine.tokenizer,
                                             engine.max_model_len)
            vectors = await encode(request, engine, inputs, body.timeout_s)
        num_tokens = sum(len(x.token_ids) for x in inputs)
        return JSONResponse(embedding_response(vectors, body, model_id, num_tokens))

    async def rerank(request: Request) -> JSONResponse:
        body = await read_json(request, RerankRequest, config.max_body_bytes,
                               config.max_json_depth)
        model_id = model_for(request, body.model, EncoderTask.SCORE)
        with ExitStack() as held:
            engine = held.enter_context(models.acquire(model_id))
            require_task(engine, model_id, EncoderTask.SCORE, "/v1/rerank")
            texts = document_texts(body)
            inputs = await run_in_threadpool(rerank_inputs, body, texts, engine.tokenizer,
                                             engine.task, engine.max_model_len)
            rows = await encode(request, engine, inputs, body.timeout_s)
        scores = relevance(rows, engine.task)
        num_tokens = sum(len(x.token_ids) for x in inputs)
        return JSONResponse(rerank_response(scores, texts, body, model_id, num_tokens))

    for path in RERANK_PATHS:
        router.add_api_route(path, rerank, methods=["POST"],
                             openapi_extra=request_body(RerankRequest),
                             responses=responses(RerankResponse, *GENERATION_ERRORS),
                             include_in_schema=path == RERANK_PATHS[0])
    return router


def _first_model_of(models: ModelResolver, task: EncoderTask) -> str:
    """The first configured model serving `task`; for rerank, else the first embedding model
    (it ranks by cosine similarity); else the default model (which then refuses the task)."""
    tasks = {}
    for name in models.model_names():
        try:
            tasks.setdefault(getattr(models.resolve(name), "task", None), name)
        except TokenserveError:
            continue  # no AVAILABLE version yet, or not served by an engine
    fallback = tasks.get(EncoderTask.EMBED) if task is EncoderTask.SCORE else None
    return tasks.get(task) or fallback or models.default_model()
