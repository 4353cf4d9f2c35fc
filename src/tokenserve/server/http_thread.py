"""An ASGI app under uvicorn on its own thread: how both frontends' HTTP ports are served
(the OpenAI API and TF Serving's REST API, launch.py; the TF Serving drop-in on its own,
tfserving/server.py)."""

from __future__ import annotations

import contextlib
import threading

import uvicorn

from tokenserve.server.tls import SSLConfig


def start_http(app, host: str, port: int, tls: SSLConfig | None = None,
               graceful_shutdown_s: float | None = 30.0) -> uvicorn.Server:
    """Serves `app` under uvicorn on its own thread, over TLS when `tls` is given; returns
    once it listens (its `should_exit = True` stops it). On shutdown, requests still running
    after `graceful_shutdown_s` are cancelled (their streams abort and free their slots):
    a client that stopped reading a stream must not keep the process from exiting. None:
    uvicorn waits for them however long they take.

    Raises:
        OSError: the port could not be opened.
    """
    files = tls.files() if tls is not None else contextlib.nullcontext({})
    with files as ssl_options:  # uvicorn reads them while starting; removed once it listens
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                               access_log=False, lifespan="off",
                                               timeout_graceful_shutdown=graceful_shutdown_s,
                                               **ssl_options))
        thread = threading.Thread(target=server.run, name=f"http-{port}", daemon=True)
        thread.start()
        while not server.started and thread.is_alive():
            thread.join(0.05)
    if not server.started:
        raise OSError(f"could not start the HTTP server on {host}:{port}")
    return server
