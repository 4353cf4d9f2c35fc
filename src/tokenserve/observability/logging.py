"""Log formats: the plain default, or one JSON object per line for log pipelines.

A request's id lives in a context variable, so every line logged while a request is being
handled (in its asyncio task or in code it calls) carries `request_id` without threading it
through every call.

Example:
    >>> configure_logging(LoggingConfig(format="json"))     # doctest: +SKIP
    >>> with request_context("cmpl-42"):                       # doctest: +SKIP
    ...     logging.getLogger("tokenserve.server").info("accepted")
    {"time": "2026-11-30T09:00:00.123Z", "level": "INFO", "logger": "tokenserve.server",
     "message": "accepted", "request_id": "cmpl-42"}
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Literal

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tokenserve_request_id", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged.
_STANDARD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "request_id", "taskName"}
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class LoggingConfig:
    """How the process logs."""

    format: Literal["plain", "json"] = "plain"
    """plain: human-readable lines; json: one JSON object per line."""
    level: str = "INFO"
    """Root log level name (DEBUG, INFO, WARNING, ERROR)."""

    def __post_init__(self) -> None:
        if self.format not in ("plain", "json"):
            raise ValueError(f"log format must be 'plain' or 'json', got {self.format!r}")
        if not isinstance(logging.getLevelName(self.level.upper()), int):
            raise ValueError(f"unknown log level {self.level!r}")


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Tags every log line inside the block (and tasks it starts) with `request_id`."""
    token = current_request_id.set(request_id)
    try:
        yield
    finally:
        current_request_id.reset(token)


class RequestIdFilter(logging.Filter):
    """Copies the current request id onto each record (`record.request_id`, None if none).

    An explicit `extra={"request_id": ...}` wins over the context variable.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id when
    the line concerns a request, exception text when there is one, and any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or current_request_id.get()
        if request_id is not None:
            entry["request_id"] = request_id
        for key, field_value in vars(record).items():
            if key not in _STANDARD_ATTRIBUTES and not key.startswith("_"):
                entry[key] = field_value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class PlainFormatter(logging.Formatter):
    """The default human-readable line, with ` [request_id=...]` appended inside a request."""

    def __init__(self) -> None:
        super().__init__(PLAIN_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", None) or current_request_id.get()
        return f"{line} [request_id={request_id}]" if request_id is not None else line


def configure_logging(config: LoggingConfig, stream: IO[str] | None = None) -> logging.Handler:
    """Installs one handler on the root logger in the configured format.

    Calling it again replaces the handler it installed before (and only that one).

    Returns:
        The installed handler.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_tokenserve", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._tokenserve = True  # type: ignore[attr-defined]
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if config.format == "json" else PlainFormatter())
    root.addHandler(handler)
    root.setLevel(config.level.upper())
    return handler
