"""`build_openai_app`: the OpenAI-compatible HTTP API as a FastAPI app.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE with
`stream: true`), POST /tokenize, POST /detokenize, GET /health (liveness), GET /ready
(readiness of the default model), GET /metrics (Prometheus, when a registry is configured).
API keys guard /v1/* and the tokenize routes; /health, /ready and /metrics stay open for
probes and scrapers. Every error, from any route, is an OpenAI error body whose status comes
from server/status.py.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenserve.errors import (InvalidRequestError, ModelNotFoundError, PayloadTooLargeError,
                               PromptTooLongError, QueueFullError, TokenserveError,
                               UnauthenticatedError)
from tokenserve.stats import RejectionStats, StatsSink

from .chat import ChatRun, chat_prompt_ids
from .completions import CompletionRun
from .config import OpenAIServerConfig
from .http import (EventStream, error_body, error_response, read_json, unless_disconnected,
                   with_error_event)
from .models import ModelResolver
from .params import bad_request, check_text
from .schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                      DetokenizeResponse, ModelList, ModelObject, TokenizeRequest,
                      TokenizeResponse)
from .streams import trace_context

_REJECTION_REASONS = [(QueueFullError, "queue_full"), (PromptTooLongError, "too_long"),
                      (PayloadTooLargeError, "too_large"), (InvalidRequestError, "invalid"),
                      (UnauthenticatedError, "unauthenticated"),
                      (ModelNotFoundError, "not_found")]


def build_openai_app(models: ModelResolver, config: OpenAIServerConfig | None = None,
                     stats: StatsSink | None = None) -> FastAPI:
    """The OpenAI-compatible app over the engines `models` resolves.

    Args:
        models: model id -> engine (StaticModels, or the TF Serving lifecycle's resolver).
        config: limits, API keys, timeout, metrics registry.
        stats: receives a RejectionStats for every request refused before the engine.

    Example:
        app = build_openai_app(StaticModels({"builtin": engine}), OpenAIServerConfig())
        uvicorn.run(app, host="0.0.0.0", port=8000)
    """
    config = config or OpenAIServerConfig()
    app = FastAPI(title="tokenserve OpenAI-compatible API", docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.exception_handler(TokenserveError)
    async def on_tokenserve_error(request: Request, error: TokenserveError) -> JSONResponse:
        if stats is not None:
            reason = next((r for kind, r in _REJECTION_REASONS if isinstance(error, kind)), None)
            if reason is not None:
                stats.on_rejection(RejectionStats(model=getattr(request.state, "model", ""),
                                                  version="", reason=reason))
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return JSONResponse(error_body(error.status_code, str(error.detail), code=code),
                            status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError):
        return JSONResponse(error_body(400, str(error)), status_code=400)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
        return error_response(error)

    async def authorized(request: Request) -> None:
        config.api_keys.check(request.headers.get("authorization"))

    def resolve(request: Request, model_id: str | None):
        model_id = model_id or models.default_model()
        request.state.model = model_id
        return model_id, models.resolve(model_id)

    @app.get("/health")
    async def health() -> Response:
        """Liveness: the process answers HTTP."""
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: the default model's engine is warmed up and its last step succeeded."""
        model_id = models.default_model()
        try:
            is_ready = models.resolve(model_id).is_ready()
        except TokenserveError as error:
            return JSONResponse({"status": "unavailable", "model": model_id,
                                 "reason": str(error)}, status_code=503)
        return JSONResponse({"status": "ready" if is_ready else "not_ready", "model": model_id},
                            status_code=200 if is_ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if config.metrics_registry is None:
            return JSONResponse(error_body(404, "Metrics are not enabled on this server."),
                                status_code=404)
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(config.metrics_registry),
                        media_type=CONTENT_TYPE_LATEST)

    guarded = [Depends(authorized)]

    @app.get("/v1/models", dependencies=guarded)
    async def list_models() -> JSONResponse:
        cards = [ModelObject(id=c.id, created=c.created, owned_by=c.owned_by, root=c.root,
                             max_model_len=c.max_model_len) for c in models.list_models()]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}", dependencies=guarded)
    async def retrieve_model(model_id: str) -> JSONResponse:
        for card in models.list_models():
            if card.id == model_id:
                return JSONResponse(ModelObject(**card.__dict__).model_dump())
        raise ModelNotFoundError(f"The model '{model_id}' does not exist.")

    async def generate(request: Request, body: CompletionRequest | ChatCompletionRequest,
                       make_job: Callable[..., CompletionRun | ChatRun]) -> Response:
        """Runs a generation while holding its model version (a reload waits for it)."""
        model_id = body.model or models.default_model()
        request.state.model = model_id
        with ExitStack() as held:
            engine = held.enter_context(models.acquire(model_id))
            job = make_job(body, engine, model_id, config, trace_context(request.headers))
            request_headers = {"X-Request-Id": job.request_id}
            try:
                await unless_disconnected(request, job.outputs.start())
            except BaseException:
                await job.outputs.aclose()
                raise
            if body.stream:
                release = held.pop_all()  # the stream outlives this handler

                async def close() -> None:
                    try:
                        await job.outputs.aclose()
                    finally:
                        release.close()

                response = EventStream(with_error_event(job.events()), on_close=close)
                response.headers.update(request_headers)
                return response
            try:
                result = await unless_disconnected(request, job.response())
            finally:
                await job.outputs.aclose()
            return JSONResponse(result.model_dump(), headers=request_headers)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        body = await read_json(request, CompletionRequest, config.max_body_bytes)
        return await generate(request, body, CompletionRun)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, ChatCompletionRequest, config.max_body_bytes)
        return await generate(request, body, ChatRun)

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_json(request, TokenizeRequest, config.max_body_bytes)
        _, engine = resolve(request, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Give exactly one of 'prompt' and 'messages'.", "prompt")
        if body.messages is not None:
            ids = chat_prompt_ids(body.messages, engine, body.add_generation_prompt)
        else:
            check_text(body.prompt, "prompt")
            ids = engine.tokenizer.encode(body.prompt)
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len,
                                             tokens=ids).model_dump())

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_json(request, DetokenizeRequest, config.max_body_bytes)
        _, engine = resolve(request, body.model)
        vocab_size = engine.config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (size "
                              f"{vocab_size}).", "tokens")
        return JSONResponse(DetokenizeResponse(
            prompt=engine.tokenizer.decode(body.tokens)).model_dump())

    return app
