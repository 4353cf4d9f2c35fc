"""The OpenAPI document of the OpenAI port (/openapi.json, browsable at /docs).

The generation routes read their bodies themselves (`http.read_json`: size limit, media type,
depth, strict types, one error shape), so FastAPI cannot infer their request schemas; each
route names its request model here instead, and `install_openapi` adds those models to the
document's components. Responses list every status a route can answer with, each with its
body schema, so a client generator or a fuzzer (schemathesis, in
tests/server/openai/test_openai_schema.py) can hold the server to them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .schemas import ErrorResponse

_REF = "#/components/schemas/{model}"

ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, wrong types, out-of-range values, a prompt that "
         "does not fit the context.",
    401: "Missing or wrong API key (when the server has keys).",
    404: "Unknown model, version or label.",
    413: "Request body over the server's limit.",
    415: "Request body sent as something other than application/json.",
    429: "The engine's queue is full; retry later.",
    503: "The model has no AVAILABLE version, or its engine has stopped.",
    504: "The request did not finish within its timeout.",
}


GENERATION_ERRORS = (400, 401, 404, 413, 415, 429, 503, 504)
"""What a generation route (completions, chat, responses) can answer besides 200."""
BODY_ERRORS = (400, 401, 404, 413, 415, 503)
"""What a route that reads a JSON body but does not generate can answer besides 200."""


SSE_EVENT = {
    "type": "object", "required": ["data"],
    "description": "One server-sent event of a `stream: true` answer (the schema applies to "
                   "each event). `data` is a chunk (the 200 body's schema, with deltas), an "
                   "`{\"error\": ...}` object if the request failed after the stream "
                   "started, or `[DONE]`, the last event.",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                   "id": {"type": "string"}, "retry": {"type": "integer"}},
}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def responses(ok: type[BaseModel] | None, *errors: int, ok_status: int = 200,
              stream: bool = False, ok_media_type: str | None = None,
              ok_description: str = "Success.") -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route: its success body and the OpenAI error body for each of
    `errors`. `stream`: the success may also be an SSE stream (`stream: true`)."""
    table: dict[int | str, dict[str, Any]] = {}
    success: dict[str, Any] = {"description": ok_description}
    if ok is not None:
        success["model"] = ok
    if stream:
        success["content"] = {"text/event-stream": {"schema": SSE_EVENT}}
    if ok_media_type is not None:
        success["content"] = {ok_media_type: {"schema": {"type": "string"}}}
    table[ok_status] = success
    for status in errors:
        table[status] = {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
    return table


def install_openapi(app: FastAPI, request_models: list[type[BaseModel]],
                    bodiless: dict[str, int]) -> None:
    """Makes `app.openapi()` build the document with `request_models` in its components.

    Args:
        request_models: the models `request_body` refers to.
        bodiless: path -> status of routes whose success has no body (e.g. /health).
    """
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(title=app.title, version=app.version,
                               description=app.description, routes=app.routes)
        _, definitions = models_json_schema([(m, "validation") for m in request_models],
                                            ref_template=_REF)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in definitions.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                # Validation errors are answered 400 with the OpenAI body, never 422.
                operation.get("responses", {}).pop("422", None)
        for path, status in bodiless.items():
            for operation in document["paths"].get(path, {}).values():
                operation["responses"][str(status)].pop("content", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = document
        return document

    app.openapi = openapi
