"""`build_openai_app`: the OpenAI-compatible HTTP API as a FastAPI app.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE with
`stream: true`), POST /tokenize, POST /detokenize, GET /health (liveness), GET /ready
(readiness of the default model), GET /metrics (Prometheus, when a registry is configured),
GET /openapi.json and /docs (the schema). With API keys, every route needs one except
/health, /ready, /openapi.json and /docs (probes and schema readers carry no keys, and none
of them tells anything about the models' traffic) and, with `metrics_public`, /metrics. The
key is checked before routing, so no path (a trailing slash, an unknown route) answers
anything but 401 to a request without a key. Every error, from any route, is an OpenAI error
body whose status comes from server/status.py.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
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
from .models import ModelId, ModelResolver
from .openapi import install_openapi, request_body, responses
from .params import bad_request, check_text, decode_ids, encode_text
from .responses import add_responses_routes
from .responses_schemas import ResponseCreateRequest
from .schemas import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                      CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                      ModelList, ModelObject, Readiness, TokenizeRequest, TokenizeResponse)
from .streams import trace_context

_REJECTION_REASONS = [(QueueFullError, "queue_full"), (PromptTooLongError, "too_long"),
                      (PayloadTooLargeError, "too_large"), (InvalidRequestError, "invalid"),
                      (UnauthenticatedError, "unauthenticated"),
                      (ModelNotFoundError, "not_found")]

UNKNOWN_MODEL_LABEL = "(unknown)"
"""The metrics label of rejections naming a model this server does not have: labelling them
with the name as sent would let any client add series (and megabytes) to /metrics."""

OPEN_PATHS = ("/health", "/ready", "/openapi.json", "/docs")
"""Routes that need no API key (plus /metrics with `metrics_public`)."""

_GENERATION_ERRORS = (400, 401, 404, 413, 415, 429, 503, 504)
_BODY_ERRORS = (400, 401, 404, 413, 415, 503)


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
    config = config or OpenAIServerConfig()
    app = FastAPI(title="tokenserve OpenAI-compatible API", version="1",
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
                  redirect_slashes=False)

    def metric_model(model_id: str) -> str:
        """The model label of a rejection: a configured model's name, else one label."""
        try:
            name = ModelId.parse(model_id).name
        except ModelNotFoundError:
            return UNKNOWN_MODEL_LABEL
        return name if name in models.model_names() else UNKNOWN_MODEL_LABEL

    def record_rejection(request_model: str | None, error: BaseException) -> None:
        if stats is None:
            return
        reason = next((r for kind, r in _REJECTION_REASONS if isinstance(error, kind)), None)
        if reason is not None:
            model = metric_model(request_model) if request_model else ""
            stats.on_rejection(RejectionStats(model=model, version="", reason=reason))

    app.add_middleware(_RequireKey, config=config,
                       on_rejected=lambda error: record_rejection(None, error))

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

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
        return error_response(error)

    def resolve(request: Request, model_id: str | None):
        model_id = model_id or models.default_model()
        request.state.model = model_id
        return model_id, models.resolve(model_id)

    @app.get("/health", responses=responses(None, ok_description="The process serves HTTP."))
    async def health() -> Response:
        """Liveness: the process answers HTTP."""
        return Response(status_code=200)

    @app.get("/ready", responses={200: {"model": Readiness, "description": "Ready."},
                                  503: {"model": Readiness, "description": "Not ready."}})
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

    @app.get("/metrics", responses={
        **responses(None, 401, ok_media_type="text/plain",
                    ok_description="Prometheus text exposition."),
        404: {"model": ErrorResponse, "description": "Metrics are not enabled."}})
    async def metrics() -> Response:
        """Prometheus metrics; needs an API key unless the server was started with
        --metrics_public."""
        if config.metrics_registry is None:
            return JSONResponse(error_body(404, "Metrics are not enabled on this server."),
                                status_code=404)
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(config.metrics_registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=responses(ModelList, 401))
    async def list_models() -> JSONResponse:
        cards = [ModelObject(id=c.id, created=c.created, owned_by=c.owned_by, root=c.root,
                             max_model_len=c.max_model_len) for c in models.list_models()]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}", responses=responses(ModelObject, 401, 404))
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
            # Off the event loop: rendering and tokenizing a long prompt takes a while, and
            # every other request and stream on this port waits for the loop.
            job = await run_in_threadpool(make_job, body, engine, model_id, config,
                                          trace_context(request.headers))
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

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
              responses=responses(CompletionResponse, *_GENERATION_ERRORS, stream=True))
    async def completions(request: Request) -> Response:
        body = await read_json(request, CompletionRequest, config.max_body_bytes,
                               config.max_json_depth)
        return await generate(request, body, CompletionRun)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
              responses=responses(ChatCompletionResponse, *_GENERATION_ERRORS, stream=True))
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, ChatCompletionRequest, config.max_body_bytes,
                               config.max_json_depth)
        return await generate(request, body, ChatRun)

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest),
              responses=responses(TokenizeResponse, *_BODY_ERRORS))
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_json(request, TokenizeRequest, config.max_body_bytes,
                               config.max_json_depth)
        _, engine = resolve(request, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Give exactly one of 'prompt' and 'messages'.", "prompt")

        def token_ids() -> list[int]:  # off the event loop, as for generation
            if body.messages is not None:
                return chat_prompt_ids(body.messages, engine, body.add_generation_prompt,
                                       check_length=False)
            check_text(body.prompt, "prompt")
            return encode_text(engine.tokenizer, body.prompt)

        ids = await run_in_threadpool(token_ids)
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len,
                                             tokens=ids).model_dump())

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest),
              responses=responses(DetokenizeResponse, *_BODY_ERRORS))
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_json(request, DetokenizeRequest, config.max_body_bytes,
                               config.max_json_depth)
        _, engine = resolve(request, body.model)
        vocab_size = engine.config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (size "
                              f"{vocab_size}).", "tokens")
        text = await run_in_threadpool(decode_ids, engine.tokenizer, body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    from tokenserve.state.response_store import MemoryResponseStore
    add_responses_routes(app, models, config, response_store or MemoryResponseStore())
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                          DetokenizeRequest, ResponseCreateRequest], bodiless={"/health": 200})
    return app
