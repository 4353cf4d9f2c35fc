"""A real Debian redis-server for tests: started on a free loopback port in a temporary
directory, never a Redis the tests did not start."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from support.servables import free_port


class RedisServer:
    """One redis-server process; `kill()` and `start()` let tests take it down and back."""

    def __init__(self, directory: Path):
        self.directory, self.port = directory, free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (scripts/test.sh installs it)")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.directory), "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def client(self):
        import redis

        return redis.Redis(port=self.port)
