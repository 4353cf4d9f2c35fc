"""One exception hierarchy for tokenserve.

Servers map these to HTTP and gRPC status codes in one table; the CLI prints
their message on one line and exits non-zero.
"""


class TokenserveError(Exception):
    """Base class of every error tokenserve raises on purpose."""


class ConfigError(TokenserveError, ValueError):
    """A configuration value is invalid."""


class UnsupportedGGUFError(ConfigError):
    """A GGUF file uses an architecture, tensor type, tokenizer or setting that tokenserve
    cannot import (model/gguf_file.py re-exports it)."""


class UnknownPresetError(ConfigError):
    """A model preset name is not known."""


class ModelNotFoundError(TokenserveError, FileNotFoundError):
    """A model directory or version does not exist."""


class ModelLoadError(TokenserveError):
    """A model exists but cannot be loaded (corrupt or incompatible)."""


class InvalidRequestError(TokenserveError, ValueError):
    """A request is malformed: bad shape, dtype or parameter.

    Args:
        message: what is wrong, for the client.
        param: the request field at fault, when one is (the OpenAI error body's `param`).
        code: a short machine-readable reason, e.g. "context_length_exceeded" (its `code`).
    """

    def __init__(self, message: str = "", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class PromptTooLongError(InvalidRequestError):
    """The prompt plus the requested tokens do not fit the model's context."""


class QueueFullError(TokenserveError):
    """The engine's waiting queue is at its request or token limit (HTTP 429, RESOURCE_EXHAUSTED)."""


class RequestAbortedError(TokenserveError):
    """A request was cancelled or aborted before it finished."""


class DeadlineExceededError(TokenserveError):
    """A request ran past its deadline (HTTP 504, DEADLINE_EXCEEDED)."""


class EngineDeadError(TokenserveError):
    """The engine loop has stopped; no request can be served (HTTP 503, UNAVAILABLE)."""


class UnauthenticatedError(TokenserveError):
    """A missing or wrong API key (HTTP 401, UNAUTHENTICATED)."""


class PayloadTooLargeError(InvalidRequestError):
    """A request body over the server's limit (HTTP 413, INVALID_ARGUMENT)."""


class UnsupportedMediaTypeError(InvalidRequestError):
    """A request body sent as something other than JSON, e.g. `text/plain` (HTTP 415,
    INVALID_ARGUMENT)."""


class ServableUnavailableError(TokenserveError):
    """The model exists but no version of it is AVAILABLE yet (HTTP 503, UNAVAILABLE)."""


class FailedPreconditionError(TokenserveError):
    """The request cannot run against this servable as it is, e.g. it names a signature the
    model does not have (HTTP 400, FAILED_PRECONDITION, as TF Serving's Predict)."""
