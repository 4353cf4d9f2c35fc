"""Optional API keys, one implementation for every frontend (OpenAI HTTP, TF Serving REST and
gRPC, the gRPC generation service).

Keys come from `--api_key` (repeatable) and the environment variable TOKENSERVE_API_KEYS
(comma-separated), read when the server starts (`APIKeys.from_sources`), never at import.
With no keys, everything is open. Clients send `Authorization: Bearer <key>` (HTTP header or
gRPC metadata `authorization`). Keys are compared in constant time.

Example:
    keys = APIKeys.from_sources(args.api_key)
    keys.check(request.headers.get("authorization"))        # raises UnauthenticatedError
    server = grpc.aio.server(interceptors=[AsyncAPIKeyInterceptor(keys)])
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping

import grpc

from tokenserve.errors import UnauthenticatedError

ENV_VAR = "TOKENSERVE_API_KEYS"
GRPC_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""gRPC methods that stay open: health checks (load balancers carry no keys) and reflection."""


class APIKeys:
    """The accepted keys; empty means authentication is off."""

    def __init__(self, keys: Iterable[str] = ()):
        self._keys = tuple(k.encode() for k in (k.strip() for k in keys) if k)

    @classmethod
    def from_sources(cls, flag_keys: Iterable[str] | None = None,
                     environ: Mapping[str, str] | None = None) -> "APIKeys":
        """Keys from the command line plus TOKENSERVE_API_KEYS in `environ` (os.environ)."""
        environ = os.environ if environ is None else environ
        env_keys = environ.get(ENV_VAR, "").split(",")
        return cls([*(flag_keys or ()), *env_keys])

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def accepts(self, authorization: str | None) -> bool:
        """True if auth is off or `authorization` is `Bearer <a known key>`."""
        if not self._keys:
            return True
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        candidate = key.strip().encode()
        # Compare against every key, so timing does not tell which key (or none) matched.
        matched = False
        for known in self._keys:
            matched |= hmac.compare_digest(candidate, known)
        return matched

    def check(self, authorization: str | None) -> None:
        """Raises UnauthenticatedError unless `accepts(authorization)`."""
        if self.accepts(authorization):
            return
        if not authorization:
            raise UnauthenticatedError("Missing API key: send the header "
                                       "'Authorization: Bearer <key>'.")
        raise UnauthenticatedError("Incorrect API key provided.")

    def check_grpc_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        """`check` on the `authorization` entry of gRPC invocation metadata."""
        value = None
        for key, item in metadata or ():
            if key.lower() == "authorization":
                value = item.decode() if isinstance(item, bytes) else item
        self.check(value)


def check_http_authorization(keys: APIKeys, headers: Mapping[str, str]) -> None:
    """The check for any HTTP frontend: raises UnauthenticatedError (HTTP 401)."""
    keys.check(headers.get("authorization"))


def _deny_handler(handler: grpc.RpcMethodHandler, message: str,
                  is_async: bool) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that fails with UNAUTHENTICATED."""
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_async(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    fn = deny_async if is_async else deny
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    factory = kinds[(handler.request_streaming, handler.response_streaming)]
    return factory(fn, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


class APIKeyInterceptor(grpc.ServerInterceptor):
    """For `grpc.server(...)`: UNAUTHENTICATED unless metadata carries a known bearer key."""

    def __init__(self, keys: APIKeys):
        self.keys = keys

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(GRPC_EXEMPT_PREFIXES):
            return handler
        try:
            self.keys.check_grpc_metadata(handler_call_details.invocation_metadata)
        except UnauthenticatedError as error:
            return _deny_handler(handler, str(error), is_async=False)
        return handler


class AsyncAPIKeyInterceptor(grpc.aio.ServerInterceptor):
    """For `grpc.aio.server(...)`: UNAUTHENTICATED unless metadata carries a known bearer key."""

    def __init__(self, keys: APIKeys):
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(GRPC_EXEMPT_PREFIXES):
            return handler
        try:
            self.keys.check_grpc_metadata(handler_call_details.invocation_metadata)
        except UnauthenticatedError as error:
            return _deny_handler(handler, str(error), is_async=True)
        return handler
