"""An error no handler expects: a 500 OpenAI error body, logged once, and the client's
keep-alive connection still serves its next request (uvicorn on loopback, httpx)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import httpx
import pytest
import uvicorn

from tokenserve.server.openai import StaticModels, build_openai_app


class BrokenEngine:
    """An engine whose every use raises what no handler maps: a bug, as the server sees it."""

    def __getattr__(self, name):
        raise RuntimeError(f"engine bug in {name}")


@pytest.fixture(scope="module")
def url():
    app = build_openai_app(StaticModels({"broken": BrokenEngine()}))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete,
                              args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def test_a_500_keeps_the_connection_for_the_next_request(url, caplog):
    body = {"model": "broken", "prompt": "x", "max_tokens": 2}
    with httpx.Client(base_url=url, timeout=30) as client, caplog.at_level(logging.ERROR):
        for _ in range(3):  # each on the same pooled connection
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 500, response.text
            assert response.json()["error"] == {
                "message": "Internal server error (RuntimeError).", "type": "server_error",
                "param": None, "code": None}
            assert client.get("/health").status_code == 200
    failures = [r for r in caplog.records if "/v1/completions failed" in r.getMessage()]
    assert len(failures) == 3 and all(r.exc_info for r in failures)
    # uvicorn's own "Exception in ASGI application" (and the dropped connection) is gone
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]
