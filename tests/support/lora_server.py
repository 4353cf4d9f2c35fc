"""`tokenserve serve` of a tiny export with LoRA flags, as a real process on free loopback
ports, for the OpenAI LoRA serving tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from support.servables import free_port


@contextlib.contextmanager
def lora_server(root: Path, model_name: str, api_key: str, *flags: str,
                timeout_s: float = 180.0):
    """Serves root/model_name (float32 compute and KV cache, 8 sequences, no UI) with
    `flags` (--max_loras, --lora_modules, ...); yields the OpenAI URL once /health answers
    200, and stops the server after. The log is root/server.log."""
    port = free_port()
    log = open(root / "server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenserve", "serve", f"--port={free_port()}",
         f"--rest_api_port={free_port()}", f"--openai_port={port}",
         f"--model_name={model_name}", f"--model_base_path={root / model_name}",
         f"--api_key={api_key}", "--precision=float32", "--kv_cache_dtype=float32",
         "--max_num_seqs=8", *flags, "--noui"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            assert process.poll() is None, (root / "server.log").read_text()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
