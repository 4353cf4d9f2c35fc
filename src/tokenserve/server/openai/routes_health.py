"""GET /health (liveness), GET /ready (readiness of the default model), GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from tokenserve.errors import TokenserveError

from .config import OpenAIServerConfig
from .http import error_body
from .models import ModelResolver
from .openapi import responses
from .schemas import ErrorResponse, Readiness


def health_router(models: ModelResolver, config: OpenAIServerConfig) -> APIRouter:
    """The probes and the Prometheus scrape; /health and /ready need no API key."""
    router = APIRouter()

    @router.get("/health", responses=responses(None,
                                               ok_description="The process serves HTTP."))
    async def health() -> Response:
        """Liveness: the process answers HTTP."""
        return Response(status_code=200)

    @router.get("/ready", responses={200: {"model": Readiness, "description": "Ready."},
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

    @router.get("/metrics", responses={
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

    return router
