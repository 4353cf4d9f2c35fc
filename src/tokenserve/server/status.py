"""The one table from tokenserve errors to HTTP status and gRPC status code.

Every frontend maps errors through `http_status` / `grpc_code`; no endpoint picks its own.
Subclasses match before their bases (the table is searched in order).
"""

from __future__ import annotations

import grpc

from tokenserve import errors

_TABLE: list[tuple[type[Exception], int, grpc.StatusCode]] = [
    (errors.PayloadTooLargeError, 413, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.UnsupportedMediaTypeError, 415, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.PromptTooLongError, 400, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.InvalidRequestError, 400, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.UnauthenticatedError, 401, grpc.StatusCode.UNAUTHENTICATED),
    (errors.ModelNotFoundError, 404, grpc.StatusCode.NOT_FOUND),
    (errors.QueueFullError, 429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.RequestAbortedError, 499, grpc.StatusCode.CANCELLED),
    (errors.ServableUnavailableError, 503, grpc.StatusCode.UNAVAILABLE),
    (errors.EngineDeadError, 503, grpc.StatusCode.UNAVAILABLE),
    (errors.ModelLoadError, 503, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceededError, 504, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.ConfigError, 400, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.FailedPreconditionError, 400, grpc.StatusCode.FAILED_PRECONDITION),
]


def _lookup(error: BaseException) -> tuple[int, grpc.StatusCode]:
    for kind, http, code in _TABLE:
        if isinstance(error, kind):
            return http, code
    return 500, grpc.StatusCode.INTERNAL


def http_status(error: BaseException) -> int:
    """HTTP status for an error; 500 for anything not a known TokenserveError."""
    return _lookup(error)[0]


def grpc_code(error: BaseException) -> grpc.StatusCode:
    """gRPC status code for an error; INTERNAL for anything unknown."""
    return _lookup(error)[1]


MAX_GRPC_DETAILS = 2048
"""Characters of a gRPC status message kept. The message travels percent-encoded in the
grpc-message trailer (up to 3 bytes a character), and clients drop trailers over 16 KiB by
default: an error quoting a long model name or regex reached the client as RESOURCE_EXHAUSTED
"received metadata size exceeds hard limit" instead of its own code and message."""


def grpc_details(message: str) -> str:
    """`message`, cut to MAX_GRPC_DETAILS characters with a note of how much was cut."""
    if len(message) <= MAX_GRPC_DETAILS:
        return message
    cut = len(message) - MAX_GRPC_DETAILS
    return f"{message[:MAX_GRPC_DETAILS]}... ({cut} more characters)"
