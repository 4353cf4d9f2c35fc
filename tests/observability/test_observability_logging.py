"""Structured logs: JSON lines with the request id from the context, and the plain default."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from tokenserve.observability.logging import (LoggingConfig, configure_logging,
                                              request_context)


@pytest.fixture
def log_stream():
    stream = io.StringIO()
    root = logging.getLogger()
    level = root.level
    yield stream
    root.setLevel(level)
    for handler in list(root.handlers):
        if getattr(handler, "_tokenserve", False):
            root.removeHandler(handler)


def test_json_lines_carry_the_request_id_only_inside_a_request(log_stream):
    configure_logging(LoggingConfig(format="json"), stream=log_stream)
    log = logging.getLogger("tokenserve.test")
    log.info("server started")
    with request_context("cmpl-1"):
        log.info("accepted %d tokens", 7, extra={"num_prompt_tokens": 7})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
    log.warning("idle")
    lines = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["server started", "accepted 7 tokens",
                                                   "failed", "idle"]
    assert [line.get("request_id") for line in lines] == [None, "cmpl-1", "cmpl-1", None]
    assert lines[1]["num_prompt_tokens"] == 7
    assert lines[1]["level"] == "INFO" and lines[1]["logger"] == "tokenserve.test"
    assert "RuntimeError: boom" in lines[2]["exception"]


def test_request_ids_do_not_leak_between_concurrent_tasks(log_stream):
    configure_logging(LoggingConfig(format="json"), stream=log_stream)
    log = logging.getLogger("tokenserve.test")

    async def handle(request_id: str) -> None:
        with request_context(request_id):
            for step in range(3):
                log.info("step %d", step, extra={"expected": request_id})
                await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(handle("a"), handle("b"))

    asyncio.run(main())
    lines = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    assert len(lines) == 6
    assert all(line["request_id"] == line["expected"] for line in lines)


def test_plain_format_and_reconfiguring_replaces_the_handler(log_stream):
    configure_logging(LoggingConfig(format="json"), stream=io.StringIO())
    configure_logging(LoggingConfig(format="plain"), stream=log_stream)
    assert sum(getattr(h, "_tokenserve", False) for h in logging.getLogger().handlers) == 1
    log = logging.getLogger("tokenserve.test")
    with request_context("cmpl-2"):
        log.info("hello")
    log.info("bye")
    first, second = log_stream.getvalue().splitlines()
    assert first.endswith("INFO tokenserve.test: hello [request_id=cmpl-2]")
    assert second.endswith("INFO tokenserve.test: bye")


def test_config_is_validated():
    with pytest.raises(ValueError):
        LoggingConfig(format="xml")
    with pytest.raises(ValueError):
        LoggingConfig(level="LOUD")
