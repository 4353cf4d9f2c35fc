"""HTTP plumbing of the OpenAI frontend: error bodies, bounded JSON bodies, SSE responses that
abort the engine when the client leaves, and disconnect-aware waiting."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from tokenserve.errors import (PayloadTooLargeError, RequestAbortedError,
                               UnsupportedMediaTypeError)
from tokenserve.server.status import http_status

from .params import bad_request
from .schemas import ErrorInfo, ErrorResponse

Model = TypeVar("Model", bound=BaseModel)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error",
                429: "rate_limit_error", 499: "request_cancelled", 503: "service_unavailable",
                504: "timeout_error"}
_ERROR_CODES = {401: "invalid_api_key", 404: "model_not_found", 413: "payload_too_large",
                415: "unsupported_media_type",
                429: "queue_full", 499: "cancelled", 503: "model_unavailable", 504: "timeout"}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error JSON for an HTTP status."""
    info = ErrorInfo(message=_encodable(message), type=_ERROR_TYPES.get(status, "server_error"),
                     param=None if param is None else _encodable(param),
                     code=code or _ERROR_CODES.get(status))
    return ErrorResponse(error=info).model_dump()


def _encodable(text: str) -> str:
    """`text` with any lone surrogate written as its escape, `\\ud800`: a message may quote
    what the client sent (an unknown model's name), JSON's `\\ud800` escape decodes to a
    string UTF-8 cannot encode, and the response would fail to render after the request
    had been refused properly. Text UTF-8 can encode comes back as it is."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(error: BaseException) -> JSONResponse:
    """Maps any exception through server/status.py to an OpenAI error response."""
    status = http_status(error)
    body = error_body(status, _public_message(error, status), getattr(error, "param", None),
                      getattr(error, "code", None))
    return JSONResponse(body, status_code=status)


def _public_message(error: BaseException, status: int) -> str:
    """The error's own message for client errors; no internals for unexpected ones."""
    if status < 500 or status in (503, 504):
        return str(error)
    return f"Internal server error ({type(error).__name__})."


def _validation_message(error: ValidationError, where: str = "") -> tuple[str, str | None]:
    first = error.errors()[0]
    param = ".".join([where] * bool(where) + [str(part) for part in first["loc"]]) or None
    extra = f" ({error.error_count() - 1} more errors)" if error.error_count() > 1 else ""
    return f"{param or 'body'}: {first['msg']}{extra}", param


def check_json_media_type(content_type: str | None) -> None:
    """Refuses bodies declared as something other than JSON (`application/json` or an
    `application/*+json` type, any parameters). A request without Content-Type is read as
    JSON, as most HTTP servers do; one that says `text/plain` or a form encoding meant
    something else, and parsing it as JSON anyway would answer a question it did not ask.

    Raises:
        UnsupportedMediaTypeError: HTTP 415.
    """
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type == "application/json" or (media_type.startswith("application/")
                                            and media_type.endswith("+json")):
        return
    raise UnsupportedMediaTypeError(f"Content-Type '{media_type}' is not supported: send the "
                                    f"request body as application/json.",
                                    code="unsupported_media_type")


def _refuse_constant(name: str) -> None:
    """NaN and Infinity are not JSON (Python's parser takes them); no field wants them."""
    raise bad_request(f"Request body is not valid JSON: {name} is not a JSON value.",
                      code="invalid_json")


def _parse_int(digits: str) -> int:
    """JSON integers as Python's int(), which refuses a literal over
    sys.get_int_max_str_digits() (4,300) digits with a ValueError that json.loads passes on
    as it is: refused here as bad JSON, where it was a 500."""
    limit, length = sys.get_int_max_str_digits(), len(digits.lstrip("-"))
    if limit and length > limit:
        raise bad_request(f"Request body is not valid JSON: an integer of {length} digits is "
                          f"longer than the {limit} this server reads.", code="invalid_json")
    return int(digits)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A `\\uD800`-`\\uDFFF` escape, perhaps: cheap to look for, so only such bodies are walked."""


def _refuse_lone_surrogates(value: dict) -> None:
    """Refuses a body with a string (value or key) that UTF-8 cannot encode: JSON's
    `\\ud800` escape, alone, decodes to one. Every field is text for a tokenizer, a
    template, a grammar or a response to echo, and each of those would fail on it later
    (a 500); checked once here, the 400 names the field.

    Raises:
        InvalidRequestError: `param` is the field's path, as validation errors give it.
    """
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _is_encodable(item):
                raise bad_request(f"'{path}' is not valid UTF-8 text (it contains a lone "
                                  f"surrogate).", path, "invalid_utf8")
            continue
        if isinstance(item, dict) and not all(_is_encodable(key) for key in item):
            where = f"'{path}' has" if path else "The body has"
            raise bad_request(f"{where} a key that is not valid UTF-8 text (it contains a "
                              f"lone surrogate).", path or None, "invalid_utf8")
        children = (list(item.items()) if isinstance(item, dict) else
                    list(enumerate(item)) if isinstance(item, list) else [])
        for key, child in reversed(children):  # the stack pops them in the body's order
            stack.append((child, f"{path}.{key}" if path else str(key)))


def _is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _nested_deeper_than(value: object, limit: int) -> bool:
    """True if arrays and objects nest more than `limit` levels (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (item.values() if isinstance(item, dict) else
                    item if isinstance(item, list) else ())
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


async def read_json(request: Request, model: type[Model], max_bytes: int,
                    max_depth: int = 64) -> Model:
    """Reads, size-checks, decodes and validates the request body as `model`.

    Raises:
        UnsupportedMediaTypeError: a Content-Type that is not JSON.
        PayloadTooLargeError: the body is (or announces itself as) over `max_bytes`.
        InvalidRequestError: not UTF-8, not JSON, nested deeper than `max_depth`, not an
            object, or wrong field types.
    """
    check_json_media_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLargeError(f"Request body of {declared} bytes is over the limit of "
                                   f"{max_bytes} bytes.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLargeError(f"Request body is over the limit of {max_bytes} bytes.")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad_request(f"Request body is not valid UTF-8 (byte {error.start}).",
                          code="invalid_utf8") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_int=_parse_int)
    except json.JSONDecodeError as error:
        raise bad_request(f"Request body is not valid JSON: {error.msg} at line "
                          f"{error.lineno} column {error.colno}.", code="invalid_json") from None
    except RecursionError:  # deeper than the parser's recursion limit (~1,000)
        too_deep = True
    else:
        too_deep = _nested_deeper_than(value, max_depth)
    if too_deep:
        raise bad_request(f"Request body is nested more than {max_depth} levels deep.",
                          code="invalid_json")
    if not isinstance(value, dict):
        raise bad_request("Request body must be a JSON object.", code="invalid_json")
    if _SURROGATE_ESCAPE.search(text):
        _refuse_lone_surrogates(value)
    return validated(model, value)


def validated(model: type[Model], value: dict, where: str = "") -> Model:
    """`value` validated strictly as `model`: a whole request body, or the part of one at
    `where` ("input.2"), whose errors then name the field from the body's top.

    Raises:
        InvalidRequestError: wrong field types (code invalid_type).
    """
    try:
        return model.model_validate(value, strict=True)
    except ValidationError as error:
        message, param = _validation_message(error, where)
        raise bad_request(message, param, "invalid_type") from None


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it if the client disconnects first (the engine iterators are
    closed by the caller's cleanup, which aborts the requests).

    Raises:
        RequestAbortedError: the client went away.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise RequestAbortedError("Client disconnected.")
    return task.result()


async def with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Passes SSE events through; an error after the stream has started (the status line is
    already sent) becomes one `data: {"error": ...}` event followed by [DONE], as in vLLM."""
    try:
        async for event in events:
            yield event
    except Exception as error:
        status = http_status(error)
        yield f"data: {json.dumps(error_body(status, _public_message(error, status)))}\n\n"
        yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """An SSE response that stops its generator as soon as the client disconnects.

    Starlette alone notices a disconnect only on the next write on some ASGI servers; this
    listens for it, cancels the stream, and always closes the generator, whose cleanup aborts
    the engine request.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str],
                 on_close: Callable[[], Awaitable[None]] | None = None):
        super().__init__(events, headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})
        self._events, self._on_close = events, on_close

    async def _send_all(self, send) -> None:
        try:
            await self.stream_response(send)
        except OSError:  # the client is gone; the finally below cleans up
            pass

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    await self._send_all(send)
                    group.cancel_scope.cancel()

                async def listen() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(listen)
        finally:
            # on_close releases the model version the stream holds: it runs even when
            # closing the generator raises, or the version could never finish unloading.
            with anyio.CancelScope(shield=True):
                try:
                    aclose = getattr(self._events, "aclose", None)
                    if aclose is not None:
                        await aclose()
                finally:
                    if self._on_close is not None:
                        await self._on_close()
