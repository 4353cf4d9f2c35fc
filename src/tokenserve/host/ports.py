"""Loopback ports for processes started on this host: the local cluster, the benchmarks' servers
and the tests' subprocesses all ask here, so there is one definition of "a free port"."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now.

    The socket is closed before the port is returned, so another process could take it first;
    a server that can listen on a socket it is handed (uvicorn's `sockets=`) avoids that race.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
