"""TensorFlow status codes at the TF Serving edge.

TF Serving answers with the status TensorFlow returned (a session's UNIMPLEMENTED, INTERNAL,
RESOURCE_EXHAUSTED ...), and maps it to HTTP with its own table (http_server.cc
`ToHTTPStatusCode`). Errors raised as `tf.errors.OpError` keep that code here; every other
error goes through tokenserve's one table (server/status.py).
"""

from __future__ import annotations

import grpc
import tensorflow as tf

from tokenserve.lifecycle.session_bundle import status_code_name
from tokenserve.server.status import grpc_code, http_status

# http_server.cc ToHTTPStatusCode
_HTTP = {"OK": 200, "CANCELLED": 499, "UNKNOWN": 500, "INVALID_ARGUMENT": 400,
         "DEADLINE_EXCEEDED": 504, "NOT_FOUND": 404, "ALREADY_EXISTS": 409,
         "PERMISSION_DENIED": 403, "RESOURCE_EXHAUSTED": 429, "FAILED_PRECONDITION": 400,
         "ABORTED": 409, "OUT_OF_RANGE": 400, "UNIMPLEMENTED": 501, "INTERNAL": 500,
         "UNAVAILABLE": 503, "DATA_LOSS": 500, "UNAUTHENTICATED": 401}


def error_grpc_code(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, tf.errors.OpError):
        return grpc.StatusCode[status_code_name(error)]
    return grpc_code(error)


def error_http_status(error: BaseException) -> int:
    if isinstance(error, tf.errors.OpError):
        return _HTTP.get(status_code_name(error), 500)
    return http_status(error)


def error_message(error: BaseException) -> str:
    """The status message: TF's own for a TF error (no Python traceback decoration)."""
    if isinstance(error, tf.errors.OpError):
        return error.message
    return str(error)


def unimplemented(message: str) -> tf.errors.UnimplementedError:
    return tf.errors.UnimplementedError(None, None, message)


def internal(message: str) -> tf.errors.InternalError:
    return tf.errors.InternalError(None, None, message)
