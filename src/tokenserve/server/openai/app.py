"""`build_openai_app`: the OpenAI-compatible HTTP API as a FastAPI app.

Routes, one `APIRouter` per group: routes_health.py (GET /health, liveness; GET /ready,
readiness of the default model; GET /metrics, Prometheus when a registry is configured),
routes_models.py (GET /v1/models), routes_generation.py (POST /v1/completions and
/v1/chat/completions, SSE with `stream: true`), routes_tokens.py (POST /tokenize and
/detokenize), routes_responses.py (the Responses API), routes_embeddings.py (POST
/v1/embeddings and /v1/rerank, for encoder models), plus GET /openapi.json and /docs (the
schema). With API keys, every route needs one except
/health, /ready, /openapi.json and /docs (probes and schema readers carry no keys, and none
of them tells anything about the models' traffic) and, with `metrics_public`, /metrics. The
key is checked before routing, so no path (a trailing slash, an unknown route) answers
anything but 401 to a request without a key. Every error, from any route, is an OpenAI error
body whose status comes from server/status.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenserve.errors import (InvalidRequestError, ModelNotFoundError, PayloadTooLargeError,
                               PromptTooLongError, QueueFullError, TokenserveError,
                               UnauthenticatedError)
from tokenserve.stats import RejectionStats, StatsSink

from .config import OpenAIServerConfig
from .embedding_schemas import EmbeddingRequest, RerankRequest
from .http import error_body, error_response
from .lora import LoraModels, lora_router
from .models import ModelId, ModelResolver
from .openapi import install_openapi
from .responses_schemas import ResponseCreateRequest
from .routes_embeddings import embeddings_router
from .routes_generation import generation_router
from .routes_health import health_router
from .routes_models import models_router
from .routes_responses import responses_router
from .routes_tokens import tokens_router
from .schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                      TokenizeRequest)

log = logging.getLogger(__name__)

_REJECTION_REASONS = [(QueueFullError, "queue_full"), (PromptTooLongError, "too_long"),
                      (PayloadTooLargeError, "too_large"), (InvalidRequestError, "invalid"),
                      (UnauthenticatedError, "unauthenticated"),
                      (ModelNotFoundError, "not_found")]

UNKNOWN_MODEL_LABEL = "(unknown)"
"""The metrics label of rejections naming a model this server does not have: labelling them
with the name as sent would let any client add series (and megabytes) to /metrics."""

OPEN_PATHS = ("/health", "/ready", "/openapi.json", "/docs")
"""Routes that need no API key (plus /metrics with `metrics_public`)."""

class _RequireKey:
    """ASGI middleware: 401 for a request without an accepted key, before routing (so no
    redirect, 404 or 405 answers an unauthenticated client first)."""

    def __init__(self, app, config: OpenAIServerConfig,
                 on_rejected: Callable[[UnauthenticatedError], None]):
        self.app, self.keys, self.on_rejected = app, config.api_keys, on_rejected
        self.open_paths = set(OPEN_PATHS) | ({"/metrics"} if config.metrics_public else set())

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and self.keys.enabled
                and scope["path"] not in self.open_paths):
            authorization = next((value.decode("latin-1") for key, value in scope["headers"]
                                  if key == b"authorization"), None)
            try:
                self.keys.check(authorization)
            except UnauthenticatedError as error:
                self.on_rejected(error)
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _AnswerUnexpected:
    """ASGI middleware: an exception no handler took becomes a 500 OpenAI error body here,
    logged once, and the connection stays open.

    Starlette answers a handler for `Exception` from its outermost middleware and then
    raises the exception again, so the server logs it a second time and closes the
    connection: a client's next request on that keep-alive connection was reset. A response
    that has already started (a stream) cannot be answered; that exception goes on up."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as error:
            if started:
                raise
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            await error_response(error)(scope, receive, send)


class _RejectionRecorder:
    """Counts a request refused before the engine (RejectionStats) under a bounded label."""

    def __init__(self, models: ModelResolver, stats: StatsSink | None):
        self.models, self.stats = models, stats

    def metric_model(self, model_id: str) -> str:
        """The model label of a rejection: a configured model's name, else one label."""
        try:
            name = ModelId.parse(model_id).name
        except ModelNotFoundError:
            return UNKNOWN_MODEL_LABEL
        return name if name in self.models.model_names() else UNKNOWN_MODEL_LABEL

    def __call__(self, request_model: str | None, error: BaseException) -> None:
        if self.stats is None:
            return
        reason = next((r for kind, r in _REJECTION_REASONS if isinstance(error, kind)), None)
        if reason is not None:
            model = self.metric_model(request_model) if request_model else ""
            self.stats.on_rejection(RejectionStats(model=model, version="", reason=reason))


def _install_error_handlers(app: FastAPI, record_rejection: _RejectionRecorder) -> None:
    """Every error, from any route, becomes an OpenAI error body (status from
    server/status.py); validation errors are 400, never FastAPI's 422. Exceptions no
    handler here maps are answered by the _AnswerUnexpected middleware."""
    @app.exception_handler(TokenserveError)
    async def on_tokenserve_error(request: Request, error: TokenserveError) -> JSONResponse:
        record_rejection(getattr(request.state, "model", None), error)
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return JSONResponse(error_body(error.status_code, str(error.detail), code=code),
                            status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError):
        return JSONResponse(error_body(400, str(error)), status_code=400)


def build_openai_app(models: ModelResolver, config: OpenAIServerConfig | None = None,
                     stats: StatsSink | None = None, response_store=None) -> FastAPI:
    """The OpenAI-compatible app over the engines `models` resolves.

    Args:
        models: model id -> engine (StaticModels, or the TF Serving lifecycle's resolver).
        config: limits, API keys, timeout, metrics registry.
        stats: receives a RejectionStats for every request refused before the engine.
        response_store: where the Responses API keeps conversations (default: in-process).

    Example:
        app = build_openai_app(StaticModels({"builtin": engine}), OpenAIServerConfig())
        uvicorn.run(app, host="0.0.0.0", port=8000)
    """
    from tokenserve.state.response_store import MemoryResponseStore

    config = config or OpenAIServerConfig()
    app = FastAPI(title="tokenserve OpenAI-compatible API", version="1",
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
                  redirect_slashes=False)
    record_rejection = _RejectionRecorder(models, stats)
    app.add_middleware(_RequireKey, config=config,
                       on_rejected=lambda error: record_rejection(None, error))
    app.add_middleware(_AnswerUnexpected)  # added last: the outermost of ours
    _install_error_handlers(app, record_rejection)
    for router in (health_router(models, config), models_router(models),
                   generation_router(models, config), tokens_router(models, config),
                   responses_router(models, config, response_store or MemoryResponseStore()),
                   embeddings_router(models, config)):
        app.include_router(router)
    if isinstance(models, LoraModels):  # adapters loaded and unloaded live
        app.include_router(lora_router(models, config.max_body_bytes))
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                          DetokenizeRequest, ResponseCreateRequest, EmbeddingRequest,
                          RerankRequest], bodiless={"/health": 200})
    return app
